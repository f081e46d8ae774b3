# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
"""The batch-invariant Triton matmul: the same row in batches of 1, 7 and 64 (and among padding
rows, as a CUDA graph's padded batch has them) gives the same bits, close to the float64 product."""

from __future__ import annotations

import pytest
import qworker_kernels.triton_invariant_matmul as im
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(120)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "has_bias"), [(48, 64, False), (70, 40, True)])
def test_a_row_is_the_same_in_batches_of_1_7_and_64(
    dtype: torch.dtype, n: int, k: int, has_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if has_bias else None
    row = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    alone = im.invariant_linear(row, weight, bias)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(alone, im.invariant_linear_reference(row, weight, bias), atol=tol, rtol=tol)
    for rows in (7, 64):
        batch = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
        for where in (0, rows // 2, rows - 1):
            batch[where] = row[0]
            assert torch.equal(im.invariant_linear(batch, weight, bias)[where], alone[0]), (rows, where)
    # Padding rows (zeros, as a padded CUDA-graph batch holds) change nothing either.
    padded = torch.zeros(im.BLOCK_M + 3, k, dtype=dtype, device=DEVICE)
    padded[0] = row[0]
    assert torch.equal(im.invariant_linear(padded, weight, bias)[0], alone[0])
