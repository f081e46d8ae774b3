"""Engine settings. Every field is also a `qworker worker` option (qworker/cli_options.py): the help
text here is the option's help, the default here its default."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from enum import Enum

# dtype names a config may use, each to its torch.dtype attribute name ("auto": see the runner).
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
# Seeds (the engine's and each request's) are signed 64-bit integers: what
# torch.Generator.manual_seed takes, and what an int64 in any producer's language holds.
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1
# vLLM's default share of the GPU's total memory for one engine instance.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# The KV pool on the CPU when neither num_kv_blocks nor kv_cache_memory_bytes is given (vLLM's CPU
# backend takes VLLM_CPU_KVCACHE_SPACE instead of a fraction: host memory is the OS's and other
# processes' too).
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30
# The largest LoRA rank an engine serves (max_lora_rank's bound).
MAX_LORA_RANK = 64
# Deprecated EngineConfig fields, each to the field that replaces it.
DEPRECATED_FIELDS = {"kv_cache_memory_gb": "kv_cache_memory_bytes"}

logger = logging.getLogger(__name__)


class SchedulingPolicy(str, Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class QuantizationMethod(str, Enum):
    """EngineConfig.quantization besides none (qworker/quantization/, docs/quantization.md)."""

    # W8A8: int8 weights per output channel, int8 activations per token, int32 sums
    INT8 = "int8"


QUANTIZATION_METHODS = tuple(method.value for method in QuantizationMethod)


class RunnerKind(str, Enum):
    """vLLM's --runner: what the engine serves (docs/pooling.md)."""

    # generate and pooling tasks, as far as the checkpoint can do them
    AUTO = "auto"
    GENERATE = "generate"
    POOLING = "pooling"


class ConvertKind(str, Enum):
    """vLLM's --convert: how a checkpoint is used for pooling (docs/pooling.md)."""

    # from the checkpoint: a *ForCausalLM embeds, a *ForSequenceClassification classifies
    AUTO = "auto"
    # no pooling adapter: a *ForCausalLM only generates
    NONE = "none"
    # pooled hidden states, whatever the checkpoint's head
    EMBED = "embed"
    # a *ForCausalLM as a yes/no classifier (Qwen3-Reranker): score = softmax([no, yes])[yes]
    CLASSIFY = "classify"


class PoolingType(str, Enum):
    """Which hidden states an embedding is made of (vLLM's pooler_config.pooling_type)."""

    LAST = "LAST"
    MEAN = "MEAN"
    CLS = "CLS"


@dataclass
class EngineConfig:
    """Engine settings. Names follow vLLM's engine arguments where one exists."""

    model: str = field(
        default="smollm2", metadata={"help": "smollm2, a local Hugging Face directory, or a .gguf file"}
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV-cache block"})
    num_kv_blocks: int | None = field(
        default=None,
        metadata={
            "help": "KV-cache blocks in the pool; wins over kv_cache_memory_bytes and "
            "gpu_memory_utilization (none: size the pool from them)"
        },
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata={
            "help": "CUDA: the fraction of the GPU's total memory this engine may use, weights, "
            "activations and KV cache together, as in vLLM; the KV pool gets what is left of it "
            f"(none: {DEFAULT_GPU_MEMORY_UTILIZATION:g}). Not used on the CPU (see "
            "kv_cache_memory_bytes)"
        },
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={
            "help": "Bytes for the KV cache, as in vLLM; wins over gpu_memory_utilization "
            f"(none: CUDA, from gpu_memory_utilization; CPU, {DEFAULT_CPU_KV_CACHE_BYTES // 2**30} GiB)"
        },
    )
    kv_cache_memory_gb: float | None = field(
        default=None,
        metadata={
            "help": "Deprecated: use kv_cache_memory_bytes. GiB for the KV cache, converted to "
            "kv_cache_memory_bytes (which then holds the value; this field goes back to none)"
        },
    )
    max_num_seqs: int = field(default=256, metadata={"help": "Most requests running in one step"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "Token budget of one step (decodes first, then prefill chunks)"}
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "Longest prompt plus output, in tokens (none: the model's limit)"}
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "Split long prompts across steps, so that decodes keep running"}
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "Reuse the KV blocks of prompt prefixes seen before (shared system prompts, "
            "few-shot examples) instead of computing them again"
        },
    )
    scheduling_policy: SchedulingPolicy = field(
        default=SchedulingPolicy.FCFS,
        metadata={"help": "fcfs: arrival order; priority: lower job priority first, then arrival"},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (bfloat16 on CUDA and on CPUs with bf16 hardware, else float32), "
            "float32, bfloat16, float16"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto (cuda when available), cpu, cuda, cuda:N"})
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto ($QWORKER_ATTENTION_BACKEND when set, else triton on CUDA and torch "
            "elsewhere), torch, triton; an explicit torch or triton wins over the variable"
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "On CUDA, run decode steps eagerly instead of replaying CUDA graphs"}
    )
    seed: int = field(
        default=0, metadata={"help": "Seed of the sampler's shared generator (a job's own seed overrides it)"}
    )
    batch_invariant: bool = field(
        default=False,
        metadata={
            "help": "Bit-identical results for a request whatever else is in its batch, its prefill "
            "chunking, prefix-cache hits and preemption (CPU; see docs/reproducibility.md)"
        },
    )
    quantization: QuantizationMethod | None = field(
        default=None,
        metadata={
            "help": "none: the checkpoint's own weights in --dtype; int8: W8A8, int8 weights per "
            "output channel and int8 activations per token with int32 sums (a bf16/fp32 checkpoint "
            "is quantized at load; embeddings and lm_head stay unquantized). A compressed-tensors "
            "W8A8 checkpoint runs int8 either way (docs/quantization.md)"
        },
    )

    disable_additional_properties: bool = field(
        default=True,
        metadata={
            "help": "Structured output: JSON objects that name their properties allow no others "
            "unless the schema says additionalProperties, as vLLM's default (xgrammar) grammar; off "
            "follows JSON Schema literally (unnamed properties allowed). A request's "
            "structured_outputs.disable_additional_properties overrides it"
        },
    )

    enable_lora: bool = field(
        default=False,
        metadata={
            "help": "Serve LoRA adapters (PEFT's format) per request, as vLLM's --enable-lora; "
            "off: the model runs without the adapter layers (docs/lora.md)"
        },
    )
    max_loras: int = field(
        default=1, metadata={"help": "Adapters that can run in one step (device slots), as in vLLM"}
    )
    max_lora_rank: int = field(
        default=16,
        metadata={"help": f"Largest adapter rank served (at most {MAX_LORA_RANK}); slots are sized to it"},
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata={
            "help": "Adapters kept loaded in host memory, least recently used evicted first "
            "(none: max_loras); at least max_loras"
        },
    )

    runner: RunnerKind = field(
        default=RunnerKind.AUTO,
        metadata={
            "help": "auto: every task the checkpoint can do; generate: generation only; pooling: "
            "embed/classify/score only, as vLLM's --runner (docs/pooling.md)"
        },
    )
    convert: ConvertKind = field(
        default=ConvertKind.AUTO,
        metadata={
            "help": "auto: from the checkpoint's architecture; none: no pooling; embed: pooled "
            "hidden states; classify: a causal LM's yes/no logits as a score (Qwen3-Reranker), "
            "as vLLM's --convert (docs/pooling.md)"
        },
    )
    pooling_type: PoolingType = field(
        default=PoolingType.LAST,
        metadata={"help": "Embeddings: LAST (the last token), MEAN (all tokens) or CLS (the first)"},
    )
    pooling_normalize: bool = field(
        default=True,
        metadata={"help": "Embeddings: L2-normalised unless a request's normalize says otherwise"},
    )

    def __post_init__(self) -> None:
        self.scheduling_policy = SchedulingPolicy(self.scheduling_policy)
        self.runner = RunnerKind(self.runner)
        self.convert = ConvertKind(self.convert)
        if not isinstance(self.pooling_type, PoolingType):
            self.pooling_type = PoolingType(str(self.pooling_type).upper())  # "mean" as vLLM's "MEAN"
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None:
            self._convert_kv_cache_memory_gb(self.kv_cache_memory_gb)
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.dtype != "auto" and self.dtype not in DTYPE_ALIASES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPE_ALIASES)}, got {self.dtype!r}")
        if not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [-2**63, 2**63 - 1], got {self.seed}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto|torch|triton, got {self.attention_backend!r}")
        if self.quantization == "none":
            self.quantization = None  # the help's name for the default
        if self.quantization is not None:
            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(
                    f"quantization must be none or {', '.join(QUANTIZATION_METHODS)} (W8A8), "
                    f"got {self.quantization!r}"
                )
            self.quantization = QuantizationMethod(self.quantization)
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept in host memory: max_cpu_loras, or max_loras when it is none."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def _convert_kv_cache_memory_gb(self, memory_gb: float) -> None:
        if self.kv_cache_memory_bytes is not None:
            raise ValueError(
                "give kv_cache_memory_bytes or the deprecated kv_cache_memory_gb, not both "
                f"(got {self.kv_cache_memory_bytes} bytes and {memory_gb} GiB)"
            )
        if not memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {memory_gb}")
        memory_bytes = int(memory_gb * 2**30)
        message = (
            f"kv_cache_memory_gb is deprecated; use kv_cache_memory_bytes={memory_bytes} "
            f"(--kv-cache-memory-bytes {memory_bytes}) instead of {memory_gb:g} GiB"
        )
        warnings.warn(message, DeprecationWarning, stacklevel=4)
        logger.warning(message)
        # One field holds the size from here on: replace() and config_to_args see bytes only.
        self.kv_cache_memory_bytes = memory_bytes
        self.kv_cache_memory_gb = None
