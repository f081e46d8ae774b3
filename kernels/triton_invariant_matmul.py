"""A batch-invariant matmul for CUDA in Triton: out = x @ weight.T (+ bias), each row's bits the
same whatever the number of rows.

Library GEMMs (cuBLAS) and autotuned Triton kernels pick tile shapes and split-K by the problem
size, so the order in which an output element adds up its K products changes with M. Here the
tile shape is one fixed configuration, K is walked in BLOCK_K steps from 0 upwards by one program
per output tile (no split-K), and rows never meet inside a tile's dot (a row's result depends on
its own inputs and the weight alone: on CUDA the tensor-core dot, whose order inside one
instruction is the hardware's; under the interpreter a per-element sum), so neither M, nor the
other rows, nor padding rows (a CUDA graph's padded batch) change a row's result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "invariant_linear", "invariant_linear_reference"]

# One configuration for every shape: the invariance comes from never choosing another.
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


# The JIT specializes an int argument equal to 1 (or divisible by 16) into a separate compiled
# kernel; the row count must not pick the code a row runs, so M stays a plain argument.
@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + k[:, None],
            mask=(cols[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        if USE_DOT:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            # The interpreter runs tl.dot as a numpy matmul, whose BLAS blocking can make a row's
            # sum depend on its place in the tile; a per-element sum over the K step cannot.
            acc += tl.sum(x[:, :, None].to(tl.float32) * w[None, :, :].to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] (rows packed), bias: [N] or None -> [M, N] in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _invariant_matmul_kernel[grid](
        x, weight, bias if bias is not None else x, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, USE_DOT=x.is_cuda, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def invariant_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The product in float64, rounded to x's dtype."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
