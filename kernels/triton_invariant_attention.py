"""Batch-invariant paged attention in Triton: one kernel for prefill chunks and decode tokens whose
result for a token depends on that token's query and its keys alone, never on the batch.

A program takes up to BLOCK_Q consecutive query tokens of one sequence (x the query heads of one
KV head) and walks the keys in TILE_N-key tiles aligned to absolute positions (tile t holds
positions [TILE_N t, TILE_N t + TILE_N)), from the first tile a row may see to the tile of its
block's last token, with an online softmax in fp32. Why a row's bits do not depend on the rest:
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
  can depend on a row's place, each element is an explicit product-and-sum over the tile.
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
import triton.language as tl
from qworker_kernels.triton_paged_attention import (
    _LOG2E,
    _check_cache_args,
    _check_out,
    _extras_args,
    _find_seq_idx,
    _head_dim_pad,
    _tanh,
    paged_attention_reference,
)

__all__ = ["BLOCK_M_MIN", "TILE_N", "invariant_paged_attention", "invariant_paged_attention_reference"]

# Keys per tile, fixed for every block size (a tile may span several cache blocks, or part of
# one): the tile boundaries, and so a token's order of additions, do not depend on block_size.
TILE_N = 32
# Rows of a program: BLOCK_M_MIN // group query tokens x the GQA group (at least the group).
BLOCK_M_MIN = 16


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr):
    # q: [BLOCK_M, HEAD_DIM_PAD], k: [HEAD_DIM_PAD, TILE_N] -> [BLOCK_M, TILE_N] fp32
    if USE_DOT:
        if DOT_IEEE:
            return tl.dot(q, k, input_precision="ieee")
        else:
            return tl.dot(q, k)
    else:
        return tl.sum(q.to(tl.float32)[:, :, None] * k.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _weighted_values(p, v, USE_DOT: tl.constexpr, DOT_IEEE: tl.constexpr):
    # p: [BLOCK_M, TILE_N] in v's dtype, v: [TILE_N, HEAD_DIM_PAD] -> [BLOCK_M, HEAD_DIM_PAD] fp32
    if USE_DOT:
        if DOT_IEEE:
            return tl.dot(p, v, input_precision="ieee")
        else:
            return tl.dot(p, v)
    else:
        return tl.sum(p.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


# The JIT specializes an int argument equal to 1 (or divisible by 16) into a separate compiled
# kernel; the batch's size must not pick the code a row runs, so these stay plain arguments.
@triton.jit(do_not_specialize=["num_seqs", "stride_qt", "stride_ot", "stride_bt"])
def _invariant_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    cap_scale,  # softmax scale / soft cap (USE_SOFT_CAP)
    cap_log2,  # soft cap * log2(e) (USE_SOFT_CAP)
    sliding_window,  # read with USE_WINDOW only
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= query_len:
        return  # an id in the slack the grid reserves for partial blocks

    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens cached before this chunk

    # Row m: query token m // NUM_QUERIES_PER_KV of the block, query head
    # kv_head * NUM_QUERIES_PER_KV + m % NUM_QUERIES_PER_KV (GQA: the group shares K/V loads).
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_t = tl.arange(0, TILE_N)
    q_pos_local = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_pos_local < query_len)
    d_valid = offs_d < HEAD_DIM
    q_tok = (q_start + q_pos_local).to(tl.int64)
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    q_abs_pos = context_len + q_pos_local  # [BLOCK_M]

    # Keys [kv_start, kv_end): from the tile holding the first row's first visible key (tile-
    # aligned, absolute) to the last row's own position.
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    kv_start = kv_end * 0
    if USE_WINDOW:
        first_q_pos = context_len + q_block_local * BLOCK_Q
        kv_start = tl.maximum(first_q_pos - sliding_window + 1, 0) // TILE_N * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start, kv_end, TILE_N):
        offs_n = start_n + offs_t  # [TILE_N] absolute key positions
        n_valid = offs_n < kv_end
        # int64: block_id * stride_kb overflows int32 on caches over 2^31 elements.
        block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + block_ids[None, :] * stride_kb + slot[None, :] * stride_ks
            + kv_head * stride_kh + offs_d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]  # fmt: skip
        if USE_SOFT_CAP:  # cap * tanh(scale * qk / cap), in base 2
            s = _tanh(_scores(q, k, USE_DOT, DOT_IEEE) * cap_scale) * cap_log2
        else:
            s = _scores(q, k, USE_DOT, DOT_IEEE) * scale_log2  # [BLOCK_M, TILE_N] fp32
        is_visible = (offs_n[None, :] <= q_abs_pos[:, None]) & n_valid[None, :]
        if USE_WINDOW:
            is_visible = is_visible & (q_abs_pos[:, None] - offs_n[None, :] < sliding_window)
        s = tl.where(is_visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Nothing visible yet: m stays -inf; subtracting 0 instead avoids NaN (p and alpha are 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + block_ids[:, None] * stride_vb + slot[:, None] * stride_vs
            + kv_head * stride_vh + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]  # fmt: skip
        acc = acc * alpha[:, None] + _weighted_values(p.to(v.dtype), v, USE_DOT, DOT_IEEE)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention for a varlen batch of new query tokens, each token's bits independent of
    the batch (see the module docstring).

    q: [num_tokens, num_heads, head_dim], the new tokens of all sequences concatenated;
    query_start_loc: [num_seqs + 1] int32 cumulative query lengths; seq_lens: [num_seqs] int32
    context lengths including the new tokens, whose K/V are already in the cache; block_tables:
    [num_seqs, max_blocks] int32. Every sequence has at least one query token. No host sync: the
    grid comes from the tensors' shapes, so a decode step can be captured in a CUDA graph.
    Returns out, shaped like q.
    """
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got {tuple(query_start_loc.shape)}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.stride(0) != 1:
        raise ValueError(
            f"query_start_loc must be contiguous int32, got {query_start_loc.dtype}, "
            f"strides {query_start_loc.stride()}"
        )
    if query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, q is on {q.device}")
    num_seqs = query_start_loc.shape[0] - 1
    _check_cache_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, scale)
    out = _check_out(out, q)
    extras, switches = _extras_args(scale, sliding_window, logits_soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m, block_q = launch_config(num_heads, num_kv_heads)
    # Upper bound on the q-blocks over all sequences (each may end in a partial block).
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _invariant_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        float(scale) * _LOG2E, *extras, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_head_dim_pad(head_dim),
        BLOCK_SIZE=block_size,
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=TILE_N,
        USE_DOT=q.is_cuda,
        DOT_IEEE=q.dtype == torch.float32,
        **switches,
        num_warps=4,
    )  # fmt: skip
    return out


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
