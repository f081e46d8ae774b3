"""How many bytes the KV pool may take, from EngineConfig (vLLM's names and meanings).

Precedence, as in vLLM: num_kv_blocks (the runner takes it as is) > kv_cache_memory_bytes >
gpu_memory_utilization.

CUDA: gpu_memory_utilization is the fraction of the device's TOTAL memory this engine may use,
weights, activations and KV cache together (vLLM's meaning; default 0.9). The KV pool gets

    utilization * total - (total - free now) - activation estimate

"free now" is read after the weights are on the device, so `total - free` counts the weights, the
CUDA context and allocator cache, and whatever other processes hold on the device. vLLM subtracts
only its own use (it refuses to start when free memory is below utilization * total); counting the
others too gives the same pool on a dedicated GPU and never overcommits a shared one. The
activation reserve is an estimate from the model's shapes and the step budget, not a profiled
forward pass as vLLM's; CUDA graph pools (captured after the KV cache) are not counted.

CPU: the fraction is not used. Host memory is shared with the OS, the page cache and other
processes, so a share of it means little (vLLM's CPU backend also sizes its KV cache in bytes,
VLLM_CPU_KVCACHE_SPACE); the pool is kv_cache_memory_bytes, else DEFAULT_CPU_KV_CACHE_BYTES.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from qworker.config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from qworker.errors import InvalidConfigError, QworkerError
from qworker.model.config import ModelConfig

logger = logging.getLogger(__name__)

# Temporaries the sampler makes per logits row (softmax, sorted copies for top-p/top-k), fp32.
SAMPLER_COPIES_PER_ROW = 3


class KVCacheMemoryError(QworkerError, ValueError):
    """gpu_memory_utilization leaves no room for a single KV block."""


def available_bytes(device: torch.device) -> int | None:
    """Memory a KV pool on `device` could take at most: the GPU's total, or on the CPU the kernel's
    MemAvailable (free plus reclaimable cache); None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(num_bytes: int, device: torch.device) -> None:
    """InvalidConfigError, at start and in one line, for a KV pool larger than the device's memory
    (the allocation would otherwise fail with a traceback, or the machine would swap)."""
    available = available_bytes(device)
    if available is not None and num_bytes > available:
        where = "the GPU has" if device.type == "cuda" else "this machine has available"
        raise InvalidConfigError(
            f"kv_cache_memory_bytes={num_bytes} ({num_bytes / 2**30:.1f} GiB) is more than {where} "
            f"({available / 2**30:.1f} GiB); give a smaller --kv-cache-memory-bytes or --num-kv-blocks"
        )


def activation_bytes_estimate(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Peak activation memory of one step, estimated: per token of max_num_batched_tokens the
    widest live tensors of a layer (gate_up and the activation, 3 x intermediate; q, k, v and the
    attention output; a few hidden-size residuals), plus fp32 logits and the sampler's copies of
    them for the sampled rows. An estimate, not a measurement."""
    num_q = model_config.num_heads * model_config.head_dim
    num_kv = model_config.num_kv_heads * model_config.head_dim
    per_token = 3 * model_config.intermediate_size + 2 * num_q + 2 * num_kv + 4 * model_config.hidden_size
    num_tokens = config.max_num_batched_tokens
    num_rows = min(config.max_num_batched_tokens, config.max_num_seqs)
    logits = num_rows * model_config.vocab_size * 4 * (1 + SAMPLER_COPIES_PER_ROW)
    return num_tokens * per_token * dtype.itemsize + logits


def kv_cache_budget_bytes(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """Bytes the KV pool may take on `device` (call it once the weights are there)."""
    if config.kv_cache_memory_bytes is not None:
        if config.gpu_memory_utilization is not None:
            logger.warning(
                "kv_cache_memory_bytes=%d wins over gpu_memory_utilization=%g, which is not used",
                config.kv_cache_memory_bytes,
                config.gpu_memory_utilization,
            )
        check_fits(config.kv_cache_memory_bytes, device)
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        if config.gpu_memory_utilization is not None:
            logger.warning(
                "gpu_memory_utilization=%g is not used on %s: the KV pool is kv_cache_memory_bytes "
                "(none: %d GiB)",
                config.gpu_memory_utilization,
                device,
                DEFAULT_CPU_KV_CACHE_BYTES // 2**30,
            )
        return DEFAULT_CPU_KV_CACHE_BYTES
    utilization = (
        DEFAULT_GPU_MEMORY_UTILIZATION
        if config.gpu_memory_utilization is None
        else config.gpu_memory_utilization
    )
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    activations = activation_bytes_estimate(config, model_config, dtype)
    budget = int(utilization * total) - in_use - activations
    gib = 2**30
    if budget <= 0:
        raise KVCacheMemoryError(
            f"gpu_memory_utilization={utilization:g} of {total / gib:.1f} GiB leaves no room for the "
            f"KV cache: {in_use / gib:.2f} GiB is in use on {device} (weights, CUDA context, other "
            f"processes) and one step's activations take about {activations / gib:.2f} GiB; raise "
            "gpu_memory_utilization, lower max_num_batched_tokens, or give kv_cache_memory_bytes"
        )
    logger.info(
        "KV cache budget %.2f GiB: gpu_memory_utilization %g of %.1f GiB, minus %.2f GiB in use "
        "and about %.2f GiB of activations",
        budget / gib,
        utilization,
        total / gib,
        in_use / gib,
        activations / gib,
    )
    return budget
