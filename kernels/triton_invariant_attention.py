"""Batch-invariant paged attention in Triton: one kernel for prefill chunks and decode tokens whose
result for a token depends on that token's query and its keys alone, never on the batch.

The kernel is the body of the default varlen kernel (`triton_paged_attention`), compiled and
launched for invariance. A program takes up to BLOCK_Q consecutive query tokens of one sequence
(x the query heads of one KV head) and walks the keys in TILE_N-key tiles aligned to absolute
positions (tile t holds positions [TILE_N t, TILE_N t + TILE_N)), from the first tile a row may see
to the tile of its block's last token, with an online softmax in fp32. Why a row's bits do not
depend on the rest:
- The tiles a row meets are fixed by its own position: the same boundaries whether it sits in a
  prefill chunk of any length, a decode step, or a chunk after a prefix-cache hit. A tile wholly
  before the row's first visible key leaves its state at exactly (m = -inf, l = 0, acc = 0), and a
  tile wholly after its own position at exactly what it was (p = 0, alpha = 1): so the other rows
  of the program, which decide how many such tiles it walks, change nothing.
- Inside a tile, a lane the row may not see gets score -inf, so weight exactly 0, and its V lane is
  either a real finite value or a masked-load 0: it adds an exact zero either way.
- Rows never meet in the reductions: on CUDA the two tl.dot products compute each output element
  from its own row (the tensor-core order along K is the hardware's, the same for every launch of
  this one configuration); under the interpreter, where tl.dot is a numpy matmul whose blocking
  can depend on a row's place, each element is an explicit product-and-sum over the tile
  (`triton_common.DOT_FP32_ROWWISE`).
- One launch configuration for every batch (BLOCK_M, TILE_N, warps fixed by the model's head
  shapes), and no split of the key range (no flash-decoding): the number of splits the default
  kernel picks from the batch size would change the order of a token's additions.
The step writes its own K/V into the cache first (`qworker_kernels.triton_kv_cache`), so every
key, old or new, is read through the block table, the same cache layout as
`qworker_kernels.triton_paged_attention`: k_cache, v_cache [num_blocks, block_size,
num_kv_heads, head_dim]. GQA, sliding windows and logit soft-capping as there.

Cost against the default kernel: decode batches of a few long sequences cannot be spread over
more programs (no split-K), and a prefill program holds BLOCK_M // group query tokens (the
default takes 64 rows for long chunks).
"""

from __future__ import annotations

import torch
import triton
from qworker_kernels.triton_common import dot_mode
from qworker_kernels.triton_paged_attention import (
    _check_out,
    _check_varlen_args,
    _extras_args,
    _launch_varlen,
    _paged_attention_varlen_kernel,
    paged_attention_reference,
)

__all__ = ["BLOCK_M_MIN", "TILE_N", "invariant_paged_attention", "invariant_paged_attention_reference"]

# Keys per tile, fixed for every block size (a tile may span several cache blocks, or part of
# one): the tile boundaries, and so a token's order of additions, do not depend on block_size.
TILE_N = 32
# Rows of a program: BLOCK_M_MIN // group query tokens x the GQA group (at least the group).
BLOCK_M_MIN = 16

# The default varlen kernel's body (triton_paged_attention), which already walks tile-aligned keys
# with rows that meet only in the dots. What makes it invariant here is the launch: one BLOCK_M,
# TILE_N and warp count per model, DOT_FP32_ROWWISE under the interpreter, and no specialization on
# the ints a batch's size sets (the JIT compiles an int equal to 1, or divisible by 16, into a
# separate kernel, so the batch would pick the code a row runs).
_invariant_attention_kernel = triton.jit(
    _paged_attention_varlen_kernel.fn, do_not_specialize=["num_seqs", "stride_qt", "stride_ot", "stride_bt"]
)


def launch_config(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q) for a model's head shapes: the only inputs, so every step of one model
    runs the same configuration."""
    group = num_heads // num_kv_heads
    block_m = max(BLOCK_M_MIN, triton.next_power_of_2(group))
    return block_m, block_m // group


def invariant_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention for a varlen batch of new query tokens, each token's bits independent of
    the batch (see the module docstring). Called as `paged_attention` is.

    q: [num_tokens, num_heads, head_dim], the new tokens of all sequences concatenated;
    query_start_loc: [num_seqs + 1] int32 cumulative query lengths; seq_lens: [num_seqs] int32
    context lengths including the new tokens, whose K/V are already in the cache; block_tables:
    [num_seqs, max_blocks] int32. Every sequence has at least one query token. No host sync: the
    grid comes from the tensors' shapes, so a decode step can be captured in a CUDA graph.
    `max_query_len` and `max_seq_len` are taken for `paged_attention`'s signature and unused: a
    launch that followed them would follow the batch. Returns out, shaped like q.
    """
    num_seqs = _check_varlen_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    out = _check_out(out, q)
    extras, switches = _extras_args(scale, sliding_window, logits_soft_cap)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_m, _ = launch_config(q.shape[1], k_cache.shape[2])
    return _launch_varlen(
        _invariant_attention_kernel, out, q, k_cache, v_cache, block_tables, query_start_loc,
        seq_lens, scale, extras, switches,
        block_m=block_m,
        tile_n=TILE_N,
        dot_mode=dot_mode(q.dtype, q.device, is_row_invariant=True),
        num_warps=4,
    )  # fmt: skip


def invariant_paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, fp32 softmax: the same math, another order."""
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
    )  # fmt: skip
