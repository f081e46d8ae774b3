"""LoRA deltas for a batch that mixes adapters: SGMV (segmented gather matrix-vector), as Punica's
and S-LoRA's kernels compute it.

The step's adapted tokens are sorted by adapter slot; segment s holds rows
`seg_starts[s]:seg_starts[s + 1]` of `token_indices`, all of slot `seg_slots[s]`. Two launches:
- shrink: `h[i] = x[token_indices[i]] @ a_t[slot of i]` ([N, W], W = slice positions * max rank);
- expand: `out[token_indices[i]] += h[i] @ b_t[slot of i]` ([N] rows of out, each once: no atomics).
Grid: (segment, row tile of the segment, column tile). Row tiles past a segment's end return at
once, so the grid's middle axis is the longest segment's tiles (`max_segment_len`, a host int the
caller knows without a sync). `h` is kept in the activations' dtype between the two launches, as
the torch path (`qworker/lora/layers.py`) keeps it.

Shapes: x [T, K], a_t [L, K, W], b_t [L, W, N], out [T, N]; token_indices [num], seg_starts
[S + 1], seg_slots [S], int64. `add_lora_sgmv_reference` is the plain-torch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qworker_kernels.constants import FLOAT_DTYPES
from qworker_kernels.triton_common import _dot, dot_mode

__all__ = ["add_lora_sgmv", "add_lora_sgmv_reference", "sgmv_expand", "sgmv_shrink"]

# tl.dot needs 16 in every dimension; LoRA widths are small (16 to 192 at rank 16 to 64).
BLOCK_M = 16
BLOCK_N_SHRINK = 16
BLOCK_K_SHRINK = 64
BLOCK_N_EXPAND = 64
BLOCK_K_EXPAND = 16


@triton.jit
def _sgmv_shrink_kernel(
    h_ptr,  # [num, W]
    x_ptr,  # [T, K]
    a_ptr,  # [L, K, W]
    token_ptr,  # [num] int64
    seg_start_ptr,  # [S + 1] int64
    seg_slot_ptr,  # [S] int64
    K,
    W,
    stride_hm,
    stride_xm,
    stride_al,
    stride_ak,
    stride_aw,
    DOT_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 < end:
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        tokens = tl.load(token_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < W
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(
                x_ptr + tokens[:, None] * stride_xm + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            a = tl.load(
                a_ptr + slot * stride_al + ks[:, None] * stride_ak + cols[None, :] * stride_aw,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc += _dot(x, a, DOT_MODE)
        tl.store(
            h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :],
            acc.to(h_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )


@triton.jit
def _sgmv_expand_kernel(
    out_ptr,  # [T, N]
    h_ptr,  # [num, W]
    b_ptr,  # [L, W, N]
    token_ptr,
    seg_start_ptr,
    seg_slot_ptr,
    W,
    N,
    stride_om,
    stride_hm,
    stride_bl,
    stride_bw,
    stride_bn,
    DOT_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 < end:
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        tokens = tl.load(token_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, W, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < W
            h = tl.load(
                h_ptr + rows.to(tl.int64)[:, None] * stride_hm + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + slot * stride_bl + ks[:, None] * stride_bw + cols[None, :] * stride_bn,
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc += _dot(h, b, DOT_MODE)
        out_offsets = tokens[:, None] * stride_om + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        base = tl.load(out_ptr + out_offsets, mask=mask, other=0.0)
        tl.store(out_ptr + out_offsets, (base.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _check_index(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, x is on {device}")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def _check_segments(
    x: torch.Tensor, token_indices: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> None:
    for name, t in (("token_indices", token_indices), ("seg_starts", seg_starts), ("seg_slots", seg_slots)):
        _check_index(name, t, x.device)
    if seg_starts.numel() != seg_slots.numel() + 1:
        raise ValueError(
            "seg_starts must have one entry more than seg_slots, got "
            f"{seg_starts.numel()} and {seg_slots.numel()}"
        )


def _check_matrix(name: str, t: torch.Tensor, dims: int, dtype: torch.dtype, device: torch.device) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} dtype {t.dtype} != x dtype {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, x is on {device}")


def sgmv_shrink(
    x: torch.Tensor,
    a_t: torch.Tensor,
    token_indices: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_segment_len: int,
) -> torch.Tensor:
    """h [num, W]: each adapted token's row of x times its slot's A (a_t [L, K, W])."""
    if x.dtype not in FLOAT_DTYPES or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float tensor, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    _check_matrix("a_t", a_t, 3, x.dtype, x.device)
    if a_t.shape[1] != x.shape[1]:
        raise ValueError(f"a_t is {tuple(a_t.shape)}, x has {x.shape[1]} features")
    _check_segments(x, token_indices, seg_starts, seg_slots)
    num, width = token_indices.numel(), a_t.shape[2]
    h = torch.empty(num, width, dtype=x.dtype, device=x.device)
    if num == 0 or seg_slots.numel() == 0:
        return h
    grid = (seg_slots.numel(), triton.cdiv(max_segment_len, BLOCK_M), triton.cdiv(width, BLOCK_N_SHRINK))
    _sgmv_shrink_kernel[grid](
        h, x, a_t, token_indices, seg_starts, seg_slots,
        x.shape[1], width, h.stride(0), x.stride(0), a_t.stride(0), a_t.stride(1), a_t.stride(2),
        DOT_MODE=dot_mode(x.dtype, x.device),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N_SHRINK, BLOCK_K=BLOCK_K_SHRINK,
    )  # fmt: skip
    return h


def sgmv_expand(
    out: torch.Tensor,
    h: torch.Tensor,
    b_t: torch.Tensor,
    token_indices: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_segment_len: int,
) -> None:
    """out[token_indices[i]] += h[i] @ b_t[slot of i], in place (b_t [L, W, N])."""
    if out.dtype not in FLOAT_DTYPES or out.dim() != 2:
        raise ValueError(f"out must be a 2-D float tensor, got {out.dtype} {tuple(out.shape)}")
    if out.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"out must be contiguous in its last dimension, got strides {out.stride()}")
    _check_matrix("h", h, 2, out.dtype, out.device)
    _check_matrix("b_t", b_t, 3, out.dtype, out.device)
    if h.shape[1] > 1 and h.stride(1) != 1:
        raise ValueError("h must be contiguous in its last dimension")
    if b_t.shape[1] != h.shape[1] or b_t.shape[2] != out.shape[1]:
        raise ValueError(f"b_t is {tuple(b_t.shape)}, h {tuple(h.shape)} and out {tuple(out.shape)}")
    _check_segments(out, token_indices, seg_starts, seg_slots)
    if h.shape[0] != token_indices.numel():
        raise ValueError(f"h has {h.shape[0]} rows for {token_indices.numel()} tokens")
    num, n = token_indices.numel(), out.shape[1]
    if num == 0 or seg_slots.numel() == 0:
        return
    grid = (seg_slots.numel(), triton.cdiv(max_segment_len, BLOCK_M), triton.cdiv(n, BLOCK_N_EXPAND))
    _sgmv_expand_kernel[grid](
        out, h, b_t, token_indices, seg_starts, seg_slots,
        h.shape[1], n, out.stride(0), h.stride(0), b_t.stride(0), b_t.stride(1), b_t.stride(2),
        DOT_MODE=dot_mode(out.dtype, out.device),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N_EXPAND, BLOCK_K=BLOCK_K_EXPAND,
    )  # fmt: skip


def add_lora_sgmv(
    out: torch.Tensor,
    x: torch.Tensor,
    a_t: torch.Tensor,
    b_t: torch.Tensor,
    token_indices: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_segment_len: int,
) -> None:
    """out[t] += (x[t] @ a_t[slot]) @ b_t[slot] for every adapted token t, in place."""
    if out.dim() == 2 and x.dim() == 2 and out.shape[0] != x.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, x {x.shape[0]}")
    h = sgmv_shrink(x, a_t, token_indices, seg_starts, seg_slots, max_segment_len)
    sgmv_expand(out, h, b_t, token_indices, seg_starts, seg_slots, max_segment_len)


def add_lora_sgmv_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    a_t: torch.Tensor,
    b_t: torch.Tensor,
    token_indices: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
) -> None:
    """The plain-torch twin of add_lora_sgmv: one segment at a time, h rounded to x's dtype."""
    starts = seg_starts.tolist()
    for s, slot in enumerate(seg_slots.tolist()):
        tokens = token_indices[starts[s] : starts[s + 1]]
        h = (x[tokens].float() @ a_t[slot].float()).to(x.dtype)
        out[tokens] = (out[tokens].float() + h.float() @ b_t[slot].float()).to(out.dtype)
