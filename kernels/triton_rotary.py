"""Rotary position embedding, rotate-half (GPT-NeoX / HF Llama) convention, applied in place to q and k.

With h = cos.shape[1] (head_dim // 2 for full rotary): x1 = x[..., :h], x2 = x[..., h:2h];
out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin; dims past 2h (partial rotary) are untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qworker_kernels.constants import FLOAT_DTYPES


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_t,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # x: [num_tokens, NUM_HEADS, head_dim]; cos, sin: [HALF_PAD] fp32, broadcast over heads.
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    ptr1 = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(ptr1, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr2, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    positions_ptr,  # [num_tokens] int64
    cos_ptr,  # [max_position, HALF] fp32
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # One program per token: the cos/sin row is loaded once for all its q and k heads.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos, sin, NUM_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def _check_args(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q and k must be [num_tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in num_tokens or head_dim")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype in {FLOAT_DTYPES}, got {q.dtype} and {k.dtype}")
    if positions.dim() != 1 or positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions must be [num_tokens={q.shape[0]}], got {tuple(positions.shape)}")
    if positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64, got {positions.dtype}")
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(
            "cos and sin must be [max_position, rotary_dim // 2], "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32, got {cos.dtype} and {sin.dtype}")
    if cos.shape[1] == 0 or 2 * cos.shape[1] > q.shape[2]:
        raise ValueError(f"cos.shape[1] ({cos.shape[1]}) must be in [1, head_dim // 2 = {q.shape[2] // 2}]")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    for name, t in (("k", k), ("positions", positions), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] in place
    by the angles of positions [num_tokens] int64; cos, sin: [max_position, head_dim // 2] float32
    (a narrower table rotates only the first 2 * cos.shape[1] dims). q and k may be strided views,
    e.g. slices of a fused qkv output. Positions must be < max_position (not checked: needs a sync).
    Returns (q, k) for convenience."""
    _check_args(q, k, positions, cos, sin)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    half = cos.shape[1]
    if num_tokens == 0:
        return q, k
    heads_pad = triton.next_power_of_2(max(num_heads, num_kv_heads))
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4 if heads_pad * half >= 1024 else 1,
    )  # fmt: skip
    return q, k


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `apply_rotary` (in place, computed in fp32)."""
    half = cos.shape[1]
    c = cos[positions][:, None, :]  # [num_tokens, 1, half]
    s = sin[positions][:, None, :]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)
    return q, k
