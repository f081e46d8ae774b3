"""RMSNorm and fused residual-add + RMSNorm, with HF LlamaRMSNorm numerics: normalize x.float(),
cast back to the input dtype, then multiply by the weight (in the input dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qworker_kernels.constants import FLOAT_DTYPES

# The plain-torch twins live in a triton-free module (the model's torch backend uses them too).
from qworker_kernels.rmsnorm_reference import fused_add_rms_norm_reference, rms_norm_reference

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_reference", "rms_norm", "rms_norm_reference"]

# One program holds a whole row in registers; wider rows than this would spill.
_MAX_HIDDEN = 65536


@triton.jit
def _store_normed_row(out_row_ptr, x, weight_ptr, offs, mask, eps, HIDDEN: tl.constexpr):
    # x: [BLOCK] fp32 holding a row of the input dtype (0 past HIDDEN); out row: weight * norm(x).
    variance = tl.sum(x * x, 0) / HIDDEN
    normed = (x * tl.rsqrt(variance + eps)).to(out_row_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    # HF multiplies in the input dtype: the product of the two rounded values, rounded once.
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_row_ptr + offs, y.to(out_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden]
    x_ptr,  # [num_rows, hidden]
    weight_ptr,  # [hidden]
    stride_out,
    stride_x,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    _store_normed_row(out_ptr + row * stride_out, x, weight_ptr, offs, mask, eps, HIDDEN)


@triton.jit
def _fused_add_rms_norm_kernel(
    out_ptr,  # [num_rows, hidden]
    residual_out_ptr,  # [num_rows, hidden]
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden]
    weight_ptr,  # [hidden]
    stride_out,
    stride_residual_out,
    stride_x,
    stride_residual,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0).to(tl.float32)
    # The model adds in its dtype, so the norm sees the rounded sum, as the unfused HF code does.
    summed = (x + r).to(residual_out_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + row * stride_residual_out + offs, summed, mask=mask)
    _store_normed_row(out_ptr + row * stride_out, summed.to(tl.float32), weight_ptr, offs, mask, eps, HIDDEN)


def _as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> a [num_rows, hidden] view or copy, contiguous in hidden."""
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _check_common(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() == 0 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must be [hidden={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    if weight.stride(0) != 1 and weight.shape[0] > 1:
        raise ValueError("weight must be contiguous")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x is on {x.device}")
    if x.shape[-1] > _MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1]} exceeds the supported {_MAX_HIDDEN}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def _launch_config(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    # About 8 to 16 elements per thread keeps the row in registers without spilling.
    num_warps = min(max(block // 512, 1), 16)
    return block, num_warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., hidden]; weight [hidden] in x's dtype.
    Returns a new tensor shaped like x."""
    _check_common(x, weight, eps)
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x_rows, out_rows = _as_rows("x", x), out.view(-1, hidden)
    if x_rows.shape[0] == 0 or hidden == 0:
        return out
    block, num_warps = _launch_config(hidden)
    _rms_norm_kernel[(x_rows.shape[0],)](
        out_rows, x_rows, weight, out_rows.stride(0), x_rows.stride(0), float(eps),
        HIDDEN=hidden, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual (rounded to x's dtype); out = rms_norm(residual_out, weight, eps).
    x, residual: [..., hidden], same shape and dtype. Returns new tensors (out, residual_out)."""
    _check_common(x, weight, eps)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), "
            f"got ({tuple(residual.shape)}, {residual.dtype}, {residual.device})"
        )
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x_rows, residual_rows = _as_rows("x", x), _as_rows("residual", residual)
    out_rows, residual_out_rows = out.view(-1, hidden), residual_out.view(-1, hidden)
    if x_rows.shape[0] == 0 or hidden == 0:
        return out, residual_out
    block, num_warps = _launch_config(hidden)
    _fused_add_rms_norm_kernel[(x_rows.shape[0],)](
        out_rows, residual_out_rows, x_rows, residual_rows, weight,
        out_rows.stride(0), residual_out_rows.stride(0), x_rows.stride(0), residual_rows.stride(0),
        float(eps),
        HIDDEN=hidden, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out, residual_out
