"""The W8A8 scaled matmul for CUDA in Triton: out = (xq @ wq.T) * x_scale[:, None] * w_scale[None, :]
(+ bias), with int8 operands and an int32 accumulator.

xq [M, K] int8 holds each row quantized with its own scale (per token, dynamic); wq [N, K] int8
each output channel with its own (per channel, symmetric, fixed at load). The int32 sums are
exact; the epilogue converts them to fp32 once, multiplies by both scales and adds the bias in
fp32, and rounds to the output dtype. On CUDA the tile product is tl.dot on int8 (int8 tensor
cores on sm_80+, int32 out). Under TRITON_INTERPRET the interpreter runs tl.dot as a numpy matmul
of the int8 arrays, whose int8 result would wrap, so it takes an explicit int32 product and sum
per output element instead (slow; tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_K", "BLOCK_N", "int8_scaled_mm", "int8_scaled_mm_reference", "quantize_rows_int8"]

BLOCK_N, BLOCK_K = 64, 64
# Rows per tile: 16 (tl.dot's smallest M) for decode-sized batches, 64 for prefill chunks.
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64
# The largest magnitude of a quantized value: symmetric int8, -127..127 for activations.
INT8_LEVELS = 127


@triton.jit
def _int8_scaled_mm_kernel(
    x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0,
        )
        # [BLOCK_K, BLOCK_N]: the weight tile read transposed.
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None],
            mask=(cols[None, :] < N) & (k[:, None] < K),
            other=0,
        )
        if USE_DOT:
            acc += tl.dot(x, w, out_dtype=tl.int32)
        else:
            acc += tl.sum(x.to(tl.int32)[:, :, None] * w.to(tl.int32)[None, :, :], axis=1)
    x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def int8_scaled_mm(
    xq: torch.Tensor,
    wq: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """xq: [M, K] int8, wq: [N, K] int8, x_scale: [M] fp32, w_scale: [N] fp32, bias: [N] or None
    -> [M, N] in out_dtype."""
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        raise ValueError(f"int8 operands expected, got {xq.dtype} and {wq.dtype}")
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"xq [M, K] and wq [N, K] expected, got {tuple(xq.shape)} and {tuple(wq.shape)}")
    m, k = xq.shape
    n = wq.shape[0]
    if x_scale.shape != (m,) or w_scale.shape != (n,):
        raise ValueError(
            f"x_scale [{m}] and w_scale [{n}] expected, got {tuple(x_scale.shape)}, {tuple(w_scale.shape)}"
        )
    xq = xq if xq.stride(1) == 1 else xq.contiguous()
    wq = wq if wq.stride(1) == 1 else wq.contiguous()
    x_scale = x_scale.to(torch.float32).contiguous()
    w_scale = w_scale.to(torch.float32).contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    block_m = SMALL_BLOCK_M if m <= SMALL_BLOCK_M else LARGE_BLOCK_M
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    _int8_scaled_mm_kernel[grid](
        xq, wq, x_scale, w_scale, bias if bias is not None else x_scale, out,
        m, n, k, xq.stride(0), wq.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, USE_DOT=xq.is_cuda,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (xq [M, K] int8, x_scale [M] fp32): per-row symmetric scales amax / 127,
    computed in fp32 from x's values; an all-zero row gets scale 0 and zeros."""
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(dim=1) / INT8_LEVELS
    # A zero row divides by 1 instead of 0: its values are zeros, and its scale stays 0.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    xq = torch.round(x32 / divisor[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return xq, scale


def int8_scaled_mm_reference(
    xq: torch.Tensor,
    wq: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same product in float64 from the exact int64 sums (on the CPU): [M, N] float64."""
    acc = (xq.cpu().to(torch.int64) @ wq.cpu().to(torch.int64).T).double()
    out = acc * x_scale.cpu().double()[:, None] * w_scale.cpu().double()[None, :]
    if bias is not None:
        out = out + bias.cpu().double()
    return out
