"""Batch-invariant execution (`EngineConfig.batch_invariant`): a request's logits do not depend on
what else is in the step, how its prompt was chunked, or whether its prefix came from the cache.

What changes, and why (measured; see docs/reproducibility.md):
- Matmuls: oneDNN picks its kernel by row count (fp32, K = 1536: 1 row differs from 2+ on the
  AVX-512 EPYC; on AMX CPUs bf16 too), so every linear layer, the MoE experts and the LM head go
  through `qworker_kernels.cpu_invariant_gemm`, whose per-element K order is fixed.
- Attention: the decode and prefill kernels reduce a token's keys in different orders (1/200
  tokens equal); `InvariantAttentionBackend` runs every token, decodes included, through
  `qworker_kernels.cpu_invariant_attention` (key tiles aligned to absolute positions).
- Norms, rotary, SiLU (the C ops) and the sampler's log_softmax/topk are per row already: measured
  bit-identical for one row in batches of 1 to 2,048; they are left as they are.

On CUDA (and on the CPU under TRITON_INTERPRET=1, with the Triton attention backend): every
matmul through `qworker_kernels.triton_invariant_matmul` (one tile configuration, no split-K),
attention through `qworker_kernels.triton_invariant_attention` (key tiles aligned to absolute
positions, no split-K, the same kernel for prefill chunks and decodes). The Triton RMSNorm, add +
RMSNorm, rotary and SiLU-and-mul kernels are left as they are: one program per row, whose block and
warp count come from the hidden size alone, so a row reduces in one order whatever the row count;
rotary and SiLU are elementwise. CUDA graphs stay on for dense models: with these kernels a padded
decode batch's padding rows cannot change a real row. MoE models run their experts one matmul
pair per expert through the invariant matmul instead of the fused-MoE kernel (which picks its
tiling by the token count); that path reads expert counts on the host, so their decode steps run
eagerly (no CUDA graphs). Not yet run on a GPU: see docs/reproducibility.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from qworker_kernels import cpu_invariant_attention, cpu_invariant_gemm
from torch import nn

from qworker.model.attention import write_kv_cache_torch
from qworker.model.attention_types import AttentionBackend, AttentionMetadata
from qworker.model.linear import PackedWeight
from qworker.model.moe import SparseMoe
from qworker.model.triton_attention import TritonAttentionBackend


class InvariantWeight(PackedWeight):
    """A PackedWeight whose matmul is the batch-invariant C GEMM (a packed copy made at first use,
    and again when the weight changes)."""

    def __init__(self) -> None:
        super().__init__(enabled=True)
        self._invariant_key: tuple[int, int, torch.dtype] | None = None
        self._invariant: cpu_invariant_gemm.PackedInvariantWeight | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features], each row's bits independent of the others."""
        if not x.is_cpu or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"batch-invariant linear needs a CPU bf16/fp32 input, got {x.device} {x.dtype}")
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if key != self._invariant_key:
            self._invariant = cpu_invariant_gemm.pack_weight(weight)
            self._invariant_key = key
        assert self._invariant is not None
        rows = x.reshape(-1, x.shape[-1])
        out = cpu_invariant_gemm.linear(rows, self._invariant, bias)
        return out.view(*x.shape[:-1], out.shape[-1])


class InvariantAttentionBackend:
    """Every token of the step, prefill or decode, through `cpu_invariant_attention`, which reads
    K/V from the cache (written first) in key tiles aligned to absolute positions.

    Measured against the alternative of running decodes as one-token chunks of the CPU prefill
    kernel (also chunk-invariant in practice: its key blocks start at position 0): that kernel
    converts a sequence's whole context to fp32 per call, which a decode step cannot amortize;
    16 prompts of 20-400 tokens, 32 greedy tokens, SmolLM2 bf16, one thread: 8.1-9.6 s with this
    kernel (before its per-key-dot speed-up) against 11.0-11.2 s (7.1 s with the mode off)."""

    name = "torch"  # the model's elementwise ops stay the CPU ones (see select_model_ops)
    supports_cuda_graphs = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        write_kv_cache_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        token_seq, token_pos = cpu_invariant_attention.token_positions(meta.seq_lens, meta.query_start_loc)
        return cpu_invariant_attention.paged_attention(
            q, k_cache, v_cache, meta.block_tables, token_seq, token_pos, scale,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip


class TritonInvariantWeight(PackedWeight):
    """A PackedWeight whose matmul is the batch-invariant Triton kernel (CUDA, or the interpreter)."""

    def __init__(self) -> None:
        super().__init__(enabled=True)
        # Imported at first use: triton reads TRITON_INTERPRET when the kernel is decorated.
        from qworker_kernels.triton_invariant_matmul import invariant_linear

        self._invariant_linear = invariant_linear

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features], each row's bits independent of the others."""
        rows = x.reshape(-1, x.shape[-1])
        out = self._invariant_linear(rows, weight, bias)
        return out.view(*x.shape[:-1], out.shape[-1])


def _replace_packed_weights(model: nn.Module, make: Callable[[], PackedWeight]) -> None:
    """Every PackedWeight of `model` (linear layers, the LM head, MoE experts) becomes make()'s."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PackedWeight):
                setattr(module, name, make())
            elif (
                isinstance(value, tuple)
                and value
                and all(isinstance(part, list) for part in value)
                and all(isinstance(w, PackedWeight) for part in value for w in part)
            ):
                # MoE experts: (gate_up weights, down weights), one PackedWeight per expert.
                setattr(module, name, tuple([make() for _ in part] for part in value))


def make_batch_invariant(model: nn.Module, device: torch.device) -> AttentionBackend:
    """Switches every matmul of `model` (linear layers, MoE experts, the LM head) to an invariant
    kernel and returns the attention backend to run it with: the Triton kernels when the model
    runs the Triton ops (CUDA, or the interpreter), the C kernels on the CPU. Raises where the mode
    is not built."""
    if getattr(model, "ops", None) is not None and model.ops.name == "triton":
        return _make_triton_invariant(model, device)
    if device.type != "cpu":
        raise ValueError(
            f"batch_invariant on {device} needs the Triton attention backend (attention_backend "
            "'auto' or 'triton'): the torch backend's attention and ops are not checked to be "
            "batch-invariant there (see docs/reproducibility.md)"
        )
    if not (cpu_invariant_gemm.is_available() and cpu_invariant_attention.is_available()):
        raise RuntimeError("batch_invariant needs the C kernels cpu_invariant_*.c, which could not be built")
    _replace_packed_weights(model, InvariantWeight)
    return InvariantAttentionBackend()


def _make_triton_invariant(model: nn.Module, device: torch.device) -> AttentionBackend:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes <= {torch.bfloat16, torch.float16, torch.float32}:
        raise ValueError(
            f"batch_invariant on Triton takes bf16, fp16 or fp32 weights, got {sorted(map(str, dtypes))}"
        )
    _replace_packed_weights(model, TritonInvariantWeight)
    has_moe = False
    for module in model.modules():
        if isinstance(module, SparseMoe):
            # The fused-MoE kernel picks its tiles by the token count: take the per-expert path
            # (grouped_experts), whose matmuls are the invariant ones replaced above.
            module._fused_moe = None
            module._is_fused_moe_looked_up = True
            has_moe = True
    # Imported here, not at module load: triton reads TRITON_INTERPRET when kernels are decorated.
    from qworker_kernels.triton_invariant_attention import invariant_paged_attention

    # Every token of the step, prefill or decode, through the invariant kernel: no host syncs and
    # no reads of the metadata's host lists, so a decode step can be captured in a CUDA graph
    # (padding rows are rows like any other); but grouped_experts reads the per-expert token
    # counts on the host.
    return TritonAttentionBackend(device, invariant_paged_attention, supports_cuda_graphs=not has_moe)
