"""Paged attention over a block-table KV cache: one varlen kernel for mixed prefill chunks and decode
rows, and a split-K (flash-decoding) kernel plus a reduce kernel for batches of single-token queries.

Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
the token at position p of sequence s lives in block block_tables[s, p // block_size], slot
p % block_size. Every launcher also has a plain-torch `*_reference` twin used by the tests.

Per-layer extras, keyword arguments of every launcher: `sliding_window` W (the query at position i
sees key j iff j <= i and i - j < W; tiles wholly before a query block's windows are never loaded,
and a windowed decode splits only its window) and `logits_soft_cap` c (the scaled scores s become
tanh(s / c) * c before the softmax, Gemma 2). Both are constexpr switches, so a layer without them
runs the same code as before they existed.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from qworker_kernels import envs
from qworker_kernels.constants import FLOAT_DTYPES, check_attention_extras
from qworker_kernels.triton_common import _dot, dot_mode, is_interpreting

_LOG2E = 1.4426950408889634
# Split-K heuristics for decode: aim for this many programs per SM, and never make a split
# shorter than this many context tokens (the reduce kernel and the extra partial writes cost
# about as much as reading a few hundred tokens of K/V).
_PROGRAMS_PER_SM = 2
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
# Keys per inner-loop tile; a tile may span several cache blocks (each key looks up its block).
_TILE_N = 64


@triton.jit
def _tanh(x):
    # tanh from one exp of a non-positive argument: no overflow, 1 - e close to 2|x| near 0.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence s owns the q-block ids [query_start_loc[s] // BLOCK_Q + s, ...): binary search for
    # the last s whose first id is <= q_block_global. The "+ s" leaves room for each sequence's
    # partial last block, so the grid size is known on the host without a sync.
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _attend_tile(
    q,  # [M, HEAD_DIM_PAD]: M query rows that share one KV head
    acc,  # [M, HEAD_DIM_PAD] fp32, unnormalized output so far
    m_i,  # [M] fp32, running max of the base-2 scores
    l_i,  # [M] fp32, running softmax denominator
    offs_n,  # [TILE_N] context positions of this tile
    n_valid,  # [TILE_N] positions inside the range this program reads
    is_visible,  # [M, TILE_N] (or broadcastable) keys each row may attend to
    k_cache_ptr,
    v_cache_ptr,
    block_table_row,  # this sequence's row of the block table
    kv_head,
    offs_d,
    d_valid,
    scale_log2,
    cap_scale,  # softmax scale / soft cap (USE_SOFT_CAP)
    cap_log2,  # soft cap * log2(e) (USE_SOFT_CAP)
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_SIZE: tl.constexpr,
    DOT_MODE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    # One step of the online softmax over a tile of keys read through the block table.
    # int64: block_id * stride_kb overflows int32 on caches over 2^31 elements.
    block_ids = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    slot = offs_n % BLOCK_SIZE
    k = tl.load(
        k_cache_ptr
        + block_ids[None, :] * stride_kb
        + slot[None, :] * stride_ks
        + kv_head * stride_kh
        + offs_d[:, None],
        mask=n_valid[None, :] & d_valid[:, None],
        other=0.0,
    )  # [HEAD_DIM_PAD, TILE_N]
    if USE_SOFT_CAP:  # cap * tanh(scale * qk / cap), in base 2
        s = _tanh(_dot(q, k, DOT_MODE) * cap_scale) * cap_log2  # [M, TILE_N] fp32
    else:
        s = _dot(q, k, DOT_MODE) * scale_log2  # [M, TILE_N] fp32
    s = tl.where(is_visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet (padding rows, empty splits) keeps m = -inf; subtracting 0
    # instead of -inf avoids NaN, and its p and alpha come out 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_cache_ptr
        + block_ids[:, None] * stride_vb
        + slot[:, None] * stride_vs
        + kv_head * stride_vh
        + offs_d[None, :],
        mask=n_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [TILE_N, HEAD_DIM_PAD]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_MODE)
    return acc, m_new, l_i


# Also the batch-invariant kernel (triton_invariant_attention compiles this body again): keep its key
# tiles aligned to absolute positions, and its rows apart everywhere but in the two _dot products.
@triton.jit
def _paged_attention_varlen_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    cap_scale,
    cap_log2,
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
    BLOCK_M: tl.constexpr,  # rows of the tile: BLOCK_Q query tokens x the GQA group
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_MODE: tl.constexpr,
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

    # Row m of the tile is query token m // NUM_QUERIES_PER_KV of this block, for query head
    # kv_head * NUM_QUERIES_PER_KV + m % NUM_QUERIES_PER_KV: the heads sharing a KV head share
    # every K/V load (GQA without repeating K/V).
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
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
    q_abs_pos = context_len + q_pos_local  # [BLOCK_M] absolute position of each row's token

    # Keys past the block's last query token are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    # Keys before the block's first query's window are masked for every row: start at its tile.
    kv_start = kv_end * 0
    if USE_WINDOW:
        first_q_pos = context_len + q_block_local * BLOCK_Q
        kv_start = tl.maximum(first_q_pos - sliding_window + 1, 0) // TILE_N * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start, kv_end, TILE_N):
        offs_n = start_n + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_end
        is_visible = (offs_n[None, :] <= q_abs_pos[:, None]) & n_valid[None, :]  # [BLOCK_M, TILE_N]
        if USE_WINDOW:
            is_visible = is_visible & (q_abs_pos[:, None] - offs_n[None, :] < sliding_window)
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, offs_n, n_valid, is_visible,
            k_cache_ptr, v_cache_ptr, block_table_row, kv_head, offs_d, d_valid, scale_log2,
            cap_scale, cap_log2,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_SIZE, DOT_MODE, USE_SOFT_CAP,
        )  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + q_tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


@triton.jit
def _paged_decode_attention_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]; written only when NUM_SPLITS == 1
    partial_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32, normalized per split
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32, base-2 log-sum-exp per split
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    scale_log2,
    cap_scale,
    cap_log2,
    sliding_window,  # read with USE_WINDOW only
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= 16: tl.dot needs at least 16 rows
    NUM_SPLITS: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_MODE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # The query (at position seq_len - 1) sees keys from window_start on; the splits share out
    # the tiles from the one holding window_start, so keys before it are never loaded.
    window_start = seq_len * 0
    if USE_WINDOW:
        window_start = tl.maximum(seq_len - sliding_window, 0)
    first_tile = window_start // TILE_N * TILE_N
    # Splits cover whole tiles so that no tile straddles two programs.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first_tile, TILE_N), NUM_SPLITS)
    split_start = first_tile + split * tiles_per_split * TILE_N
    split_end = tl.minimum(seq_len, split_start + tiles_per_split * TILE_N)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * NUM_QUERIES_PER_KV + offs_g
    g_valid = offs_g < NUM_QUERIES_PER_KV
    d_valid = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    q = tl.load(
        q_ptr + seq64 * stride_qs + head[:, None] * stride_qh + offs_d[None, :],
        mask=g_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq64 * stride_bt
    for start_n in range(split_start, split_end, TILE_N):
        offs_n = start_n + tl.arange(0, TILE_N)
        n_valid = (offs_n < split_end) & (offs_n >= window_start)
        # One query token per sequence: every key of the split is visible to every row.
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, offs_n, n_valid, n_valid[None, :],
            k_cache_ptr, v_cache_ptr, block_table_row, kv_head, offs_d, d_valid, scale_log2,
            cap_scale, cap_log2,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_SIZE, DOT_MODE, USE_SOFT_CAP,
        )  # fmt: skip

    is_empty = l_i == 0.0  # a split past the end of a short sequence
    o = acc / tl.where(is_empty, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq64 * stride_os + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_valid[:, None] & d_valid[None, :],
        )
    else:
        row = (seq64 * NUM_HEADS + head) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], o, mask=g_valid[:, None])
        lse = tl.where(is_empty, float("-inf"), m_i + tl.log2(tl.where(is_empty, 1.0, l_i)))
        tl.store(partial_lse_ptr + row, lse, mask=g_valid)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PAD] fp32
    partial_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32
    stride_os,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = offs_s < NUM_SPLITS
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    lse = tl.load(partial_lse_ptr + row, mask=s_valid, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # empty splits (lse = -inf) weigh 0
    partial = tl.load(
        partial_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_valid[:, None], other=0.0
    )
    total = tl.sum(weight, 0)
    o = tl.sum(partial * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# ----------------------------------------------------------------------------------------------
# Launchers


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device | None = None
) -> int:
    """Number of context splits for split-K decode on `device`, by the policy that
    QWORKER_DECODE_SPLITS names (`decode_num_splits`; read per call, so a CUDA graph keeps the
    choice made when it was captured)."""
    if device is not None and device.type == "cuda" and not is_interpreting(device):
        num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        num_sms = 4  # interpreter / CPU: keep the grid small
    policy = envs.QWORKER_DECODE_SPLITS.get() or DEFAULT_SPLIT_POLICY
    return decode_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, policy)


# QWORKER_DECODE_SPLITS: the split-K policy. "fill" (the default): enough programs for
# _PROGRAMS_PER_SM per SM, no split under _MIN_TOKENS_PER_SPLIT tokens. "wave": the same target
# rounded up to a power of two, and splits down to one tile (_TILE_N keys) while the unsplit grid
# is less than one wave (num_seqs * num_kv_heads < num_sms), where a step is latency-bound and the
# extra reduce costs less than idle SMs (H200 sweep: batch 1 x 2048 best at 32 splits, "fill"
# picks 8; batch 16 x 2048 best at 4, "fill" picks 3). A candidate until a GPU run A/Bs it.
SPLIT_POLICY_ENV = envs.QWORKER_DECODE_SPLITS.name
SPLIT_POLICIES = ("fill", "wave")
DEFAULT_SPLIT_POLICY = "fill"


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, policy: str) -> int:
    """Splits of `max_seq_len` keys for a grid of num_seqs * num_kv_heads programs on num_sms SMs."""
    if policy not in SPLIT_POLICIES:
        raise ValueError(f"{SPLIT_POLICY_ENV} must be one of {SPLIT_POLICIES}, got {policy!r}")
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, programs)
    min_tokens = _MIN_TOKENS_PER_SPLIT
    if policy == "wave":
        wanted = triton.next_power_of_2(wanted)
        if programs < num_sms:
            min_tokens = _TILE_N
    by_length = triton.cdiv(max(1, max_seq_len), min_tokens)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def _check_cache_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    scale: float,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q dtype must be one of {FLOAT_DTYPES}, got {q.dtype}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) != head_dim of the cache ({k_cache.shape[3]})")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if block_tables.shape[1] > 0 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens must be [num_seqs={num_seqs}], got {tuple(seq_lens.shape)}")
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32, got {seq_lens.dtype}")
    if num_seqs > 0 and seq_lens.stride(0) != 1:
        raise ValueError("seq_lens must be contiguous")
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in head_dim, got strides {out.stride()}")
    return out


def _head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


def _extras_args(
    scale: float, sliding_window: int | None, logits_soft_cap: float | None
) -> tuple[tuple[float, float, int], dict[str, bool]]:
    """(cap_scale, cap_log2, sliding_window) for the kernels, and their USE_* switches."""
    check_attention_extras(sliding_window, logits_soft_cap)
    cap = 1.0 if logits_soft_cap is None else float(logits_soft_cap)
    # Unread without USE_WINDOW; 1 rather than 0 keeps Triton's specialization of it steady.
    window = 1 if sliding_window is None else sliding_window
    switches = {"USE_WINDOW": sliding_window is not None, "USE_SOFT_CAP": logits_soft_cap is not None}
    return (float(scale) / cap, cap * _LOG2E, window), switches


def _check_varlen_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> int:
    """The varlen launchers' checks; returns num_seqs."""
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1], got {tuple(query_start_loc.shape)}")
    if query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32, got {query_start_loc.dtype}")
    if query_start_loc.stride(0) != 1:
        raise ValueError("query_start_loc must be contiguous")
    if query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, q is on {q.device}")
    num_seqs = query_start_loc.shape[0] - 1
    _check_cache_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, scale)
    return num_seqs


def _launch_varlen(
    kernel: triton.JITFunction,
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    extras: tuple[float, float, int],
    switches: dict[str, bool],
    *,
    block_m: int,
    tile_n: int,
    dot_mode: int,
    num_warps: int,
) -> torch.Tensor:
    """Launches `kernel` (the varlen kernel's body: `_paged_attention_varlen_kernel`, or its
    invariant compile) on checked, non-empty arguments; BLOCK_M rows of BLOCK_M // group tokens."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = query_start_loc.shape[0] - 1
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_queries_per_kv = num_heads // num_kv_heads
    block_q = block_m // num_queries_per_kv
    # Upper bound on the q-blocks over all sequences; see _find_seq_idx.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        float(scale) * _LOG2E, *extras, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_head_dim_pad(head_dim),
        BLOCK_SIZE=block_size,
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        DOT_MODE=dot_mode,
        **switches,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its whole cached context.

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32, each >= 1 and
    counting the query token, whose K/V must already be in the cache. Returns out, shaped like q.

    The context is split into `num_splits` parts handled by separate programs (flash-decoding),
    and a second kernel merges them, so a few long sequences still fill the GPU. With
    num_splits=None it is chosen from the batch size and `max_seq_len` (an upper bound on
    seq_lens; defaults to block_tables.shape[1] * block_size, which needs no device sync).
    `sliding_window` and `logits_soft_cap`: see the module docstring; with a window the splits
    share out the window only.
    """
    num_seqs = q.shape[0] if q.dim() == 3 else -1
    _check_cache_args(q, k_cache, v_cache, block_tables, seq_lens, num_seqs, scale)
    out = _check_out(out, q)
    extras, switches = _extras_args(scale, sliding_window, logits_soft_cap)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        # A window (plus the tile it starts in) is all a query reads.
        keys_read = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + _TILE_N)
        num_splits = choose_decode_num_splits(num_seqs, num_kv_heads, keys_read, q.device)

    num_queries_per_kv = num_heads // num_kv_heads
    head_dim_pad = _head_dim_pad(head_dim)
    tile_n = max(_TILE_N, triton.next_power_of_2(block_size))
    if num_splits > 1:
        partial_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:  # the kernel writes `out` directly; these pointers are never touched
        partial_out = partial_lse = out
    _paged_decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, partial_out, partial_lse, q, k_cache, v_cache, block_tables, seq_lens,
        float(scale) * _LOG2E, *extras,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        GROUP_PAD=max(16, triton.next_power_of_2(num_queries_per_kv)),
        NUM_SPLITS=num_splits,
        TILE_N=tile_n,
        DOT_MODE=dot_mode(q.dtype, q.device),
        **switches,
        num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_lse, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )  # fmt: skip
    return out


def paged_attention(
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
    """Causal attention for a varlen batch of new query tokens (prefill chunks and decode rows).

    q: [num_tokens, num_heads, head_dim], the new tokens of all sequences concatenated;
    query_start_loc: [num_seqs + 1] int32 cumulative query lengths (starting at 0, ending at
    num_tokens); seq_lens: [num_seqs] int32 context length including the new tokens, whose K/V are
    already in the cache; block_tables: [num_seqs, max_blocks] int32 (padding entries must be valid
    block ids). The j-th query of sequence s sits at position seq_lens[s] - query_len[s] + j and
    attends to positions <= its own. Every sequence must have at least one query token.

    `max_query_len` (known to the caller on the host) picks the tile size; when it is 1, or when
    it is None and num_tokens == num_seqs, the batch goes to `paged_decode_attention` (split-K).
    `max_seq_len` is forwarded there to pick the number of splits. `sliding_window` and
    `logits_soft_cap`: see the module docstring. Returns out, shaped like q.
    """
    num_seqs = _check_varlen_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    out = _check_out(out, q)
    extras, switches = _extras_args(scale, sliding_window, logits_soft_cap)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len == 1 or (max_query_len is None and num_tokens == num_seqs):
        return paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out, max_seq_len=max_seq_len,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip

    num_queries_per_kv = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(num_queries_per_kv)
    query_len_hint = max_query_len if max_query_len is not None else triton.cdiv(num_tokens, num_seqs)
    # Small tiles waste less on decode rows and short chunks; long prefill chunks want more
    # query rows per K/V tile loaded.
    block_m = max(64 if query_len_hint >= 64 else 16, group_pad)
    return _launch_varlen(
        _paged_attention_varlen_kernel, out, q, k_cache, v_cache, block_tables, query_start_loc,
        seq_lens, scale, extras, switches,
        block_m=block_m,
        tile_n=max(_TILE_N, triton.next_power_of_2(block_size)),
        dot_mode=dot_mode(q.dtype, q.device),
        # sm_90 compile: BLOCK_M=64 needs about 190 registers a thread at 4 warps, 140 at 8.
        num_warps=8 if block_m >= 64 else 4,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Plain-torch references


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:  # -> [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = triton.cdiv(seq_len, block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kvh, d]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention_reference(
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
    """Plain-torch `paged_attention`: one sequence at a time, fp32 softmax."""
    out = torch.empty_like(q) if out is None else out
    num_heads = q.shape[1]
    num_queries_per_kv = num_heads // k_cache.shape[2]
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_s = q[starts[s] : starts[s + 1]].float()  # [query_len, num_heads, head_dim]
        query_len = q_s.shape[0]
        if query_len == 0:
            continue
        k = _gather_context(k_cache, block_tables[s], seq_len).float()
        v = _gather_context(v_cache, block_tables[s], seq_len).float()
        k = k.repeat_interleave(num_queries_per_kv, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(num_queries_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_s, k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]  # [query_len, seq_len]
        if sliding_window is not None:
            hidden |= q_pos[:, None] - k_pos[None, :] >= sliding_window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[s] : starts[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Plain-torch `paged_decode_attention` (num_splits does not change the math)."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
    )  # fmt: skip
