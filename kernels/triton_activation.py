"""SiLU-and-mul for gated MLPs: x [num_tokens, 2 * I] holds the gate then the up projection;
out [num_tokens, I] = silu(gate) * up, computed in fp32 and rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qworker_kernels.constants import FLOAT_DTYPES

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_tokens, I]
    x_ptr,  # [num_tokens, 2 * I]
    stride_out,
    stride_x,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] (gate, then up) -> new tensor [..., I] = silu(gate) * up."""
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must be [..., 2 * I] with an even last dimension, got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}")
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    intermediate = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], intermediate), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x_rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out_rows = out.view(-1, intermediate)
    block = min(_BLOCK, triton.next_power_of_2(intermediate))
    grid = (x_rows.shape[0], triton.cdiv(intermediate, block))
    _silu_and_mul_kernel[grid](
        out_rows, x_rows, out_rows.stride(0), x_rows.stride(0),
        INTERMEDIATE=intermediate, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain torch, in fp32: silu(gate) * up."""
    intermediate = x.shape[-1] // 2
    gate, up = x[..., :intermediate].float(), x[..., intermediate:].float()
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
