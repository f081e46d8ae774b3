# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
"""The W8A8 Triton matmul against a float64 reference from exact int64 sums: int32 accumulation
exact (unit scales, sums below 2**24 that fp32 holds), scales, bias, bf16 output, zero rows."""

from __future__ import annotations

import pytest
import qworker_kernels.triton_int8_matmul as qm
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(120)


def test_int32_sums_are_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    m, n, k = 3, 70, 200  # K spans four tiles, the last partial; N two, partial
    xq = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
    wq = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    xq[0] = 127
    wq[:, :] = wq.where(torch.arange(n)[:, None] % 2 == 1, torch.tensor(-128, dtype=torch.int8))
    ones_m, ones_n = torch.ones(m), torch.ones(n)
    out = qm.int8_scaled_mm(xq.to(DEVICE), wq.to(DEVICE), ones_m.to(DEVICE), ones_n.to(DEVICE))
    exact = xq.to(torch.int64) @ wq.to(torch.int64).T
    assert torch.equal(out.cpu().to(torch.int64), exact)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "has_bias"), [(1, 48, 64, False), (20, 70, 100, True)])
def test_scaled_product_matches_the_reference(
    out_dtype: torch.dtype, m: int, n: int, k: int, has_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen) * 2
    x[m // 2] = 0  # a zero row: scale 0, output the bias
    xq, x_scale = qm.quantize_rows_int8(x)
    assert x_scale[m // 2] == 0 and (xq[m // 2] == 0).all()
    assert int(xq.to(torch.int16).abs().max()) <= qm.INT8_LEVELS
    wq = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen) if has_bias else None
    out = qm.int8_scaled_mm(
        xq.to(DEVICE), wq.to(DEVICE), x_scale.to(DEVICE), w_scale.to(DEVICE),
        bias.to(DEVICE) if bias is not None else None, out_dtype=out_dtype,
    )  # fmt: skip
    assert out.dtype == out_dtype and out.shape == (m, n)
    expected = qm.int8_scaled_mm_reference(xq, wq, x_scale, w_scale, bias)
    tol = 1e-6 if out_dtype is torch.float32 else 8e-3
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=1e-6)
    # The quantized product stays close to the float one.
    dense = x.double() @ (wq.double() * w_scale.double()[:, None]).T
    if bias is not None:
        dense = dense + bias.double()
    assert (expected - dense).abs().max() <= 0.02 * dense.abs().max()


def test_bad_operands_are_refused() -> None:
    x = torch.zeros(2, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 operands"):
        qm.int8_scaled_mm(x.float(), x, torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="xq"):
        qm.int8_scaled_mm(x, torch.zeros(3, 4, dtype=torch.int8), torch.ones(2), torch.ones(3))


def test_compiles_for_sm90_with_int8_tensor_cores(compile_for_sm90) -> None:
    pointers = {
        "x_ptr": "*i8", "w_ptr": "*i8", "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
        "bias_ptr": "*bf16", "out_ptr": "*bf16",
    }  # fmt: skip
    tiles = dict(BLOCK_N=qm.BLOCK_N, BLOCK_K=qm.BLOCK_K)
    specs = [
        dict(kernel="_int8_scaled_mm_kernel", pointer_types=pointers,
             constexprs=dict(HAS_BIAS=True, USE_DOT=True, BLOCK_M=block_m, **tiles))
        for block_m in (qm.SMALL_BLOCK_M, qm.LARGE_BLOCK_M)
    ]  # fmt: skip
    for spec, result in zip(specs, compile_for_sm90("triton_int8_matmul", specs), strict=True):
        assert result["ptx_has_mma"], f"tl.dot did not lower to int8 MMA: {spec}"
        assert result["stack_bytes"] in (None, 0), result
