"""Triton pieces the kernel modules share: the one `_dot` and its table of modes, chosen per launch
by `dot_mode`.

DOT_MODE, a constexpr of every kernel that multiplies tiles:
- DOT_NATIVE: tl.dot on the operands as loaded: fp16/bf16 on tensor cores, fp32 accumulation.
- DOT_FP32_IEEE: both operands upcast to fp32, exact fp32 products (input_precision="ieee", no
  TF32). For fp32 operands (the cast is a no-op), and for bf16 under TRITON_INTERPRET: the
  interpreter holds bf16 as uint16 bits and its numpy matmul would multiply the bit patterns.
- DOT_FP32_ROWWISE: an explicit fp32 product and sum per output element, for the batch-invariant
  kernels under the interpreter, where tl.dot is a numpy matmul whose blocking may depend on a row's
  place in the tile. Slow; never used on CUDA, where the tensor-core order along K is fixed by the
  launch configuration.
fp16 stays DOT_NATIVE under the interpreter too: numpy multiplies fp16 operands exactly into the
fp32 accumulator, as the GPU does, and the interpreter then runs the GPU's own tl.dot call, with its
operand dtype checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qworker_kernels.constants import is_triton_interpreter_enabled

__all__ = ["DOT_FP32_IEEE", "DOT_FP32_ROWWISE", "DOT_NATIVE", "dot_mode", "is_interpreting"]

DOT_NATIVE = 0
DOT_FP32_IEEE = 1
DOT_FP32_ROWWISE = 2


@triton.jit
def _dot(a, b, DOT_MODE: tl.constexpr):
    # a: [M, K], b: [K, N] -> [M, N] fp32. The modes are compared as literals: triton.jit reads a
    # module global only if it is a tl.constexpr, and the launchers pass plain ints.
    if DOT_MODE == 2:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif DOT_MODE == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def is_interpreting(device: torch.device) -> bool:
    """True when a launch on `device` runs under Triton's interpreter (any tensor off CUDA can
    only run there)."""
    return device.type != "cuda" or is_triton_interpreter_enabled()


def dot_mode(dtype: torch.dtype, device: torch.device, *, is_row_invariant: bool = False) -> int:
    """The DOT_MODE for tiles of `dtype` on `device` (see the module docstring).
    `is_row_invariant`: each output row's bits must not depend on the tile's other rows."""
    if is_interpreting(device):
        if is_row_invariant:
            return DOT_FP32_ROWWISE
        return DOT_FP32_IEEE if dtype in (torch.float32, torch.bfloat16) else DOT_NATIVE
    return DOT_FP32_IEEE if dtype == torch.float32 else DOT_NATIVE
