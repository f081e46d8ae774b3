# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
from collections.abc import Callable

import pytest
import qworker_kernels.triton_activation as act
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(60)

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((1, 2), torch.float32),
        ((7, 2 * 576), torch.float32),
        ((3, 2 * 1536), torch.bfloat16),  # I > the 1024 block: two column programs per row
        ((2, 5, 2 * 100), torch.float16),  # leading dims flattened; I not a power of two
    ],
)
def test_silu_and_mul_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape, device=DEVICE) * 4).to(dtype)
    out = act.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out.float(), act.silu_and_mul_reference(x).float(), **TOLERANCE[dtype])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, interpreter only
def test_silu_and_mul_matches_hf_formula_and_extremes() -> None:
    # HF LlamaMLP: act_fn(gate_proj(x)) * up_proj(x) with SiLU; large |gate| must not overflow to NaN.
    gate = torch.tensor([[-100.0, -10.0, -1.0, 0.0, 1.0, 10.0, 100.0, 3.0]], device=DEVICE)
    up = torch.linspace(-2, 2, 8, device=DEVICE)[None]
    out = act.silu_and_mul(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)


def test_silu_and_mul_row_strided_input() -> None:
    buffer = torch.randn((4, 300), device=DEVICE)
    x = buffer[:, :200]  # rows 300 apart, last dim contiguous
    torch.testing.assert_close(act.silu_and_mul(x), act.silu_and_mul_reference(x))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(rows=st.integers(1, 5), intermediate=st.integers(1, 300))
def test_silu_and_mul_property_shapes(rows: int, intermediate: int) -> None:
    x = torch.randn((rows, 2 * intermediate), device=DEVICE)
    torch.testing.assert_close(act.silu_and_mul(x), act.silu_and_mul_reference(x))


def test_silu_and_mul_empty() -> None:
    assert act.silu_and_mul(torch.empty((0, 8), device=DEVICE)).shape == (0, 4)


# Built on the device, not moved there: `.to("cuda")` of a strided view returns a contiguous copy.
@pytest.mark.parametrize(
    ("make_x", "message"),
    [
        (lambda: torch.zeros((2, 7), device=DEVICE), "even"),
        (lambda: torch.zeros((), device=DEVICE), "even"),
        (lambda: torch.zeros((2, 8), dtype=torch.int32, device=DEVICE), "dtype"),
        (lambda: torch.zeros((2, 16), device=DEVICE)[:, ::2], "contiguous"),
    ],
    ids=["odd_last_dim", "scalar", "int_dtype", "strided_last_dim"],
)
def test_silu_and_mul_rejects_bad_input(make_x: Callable[[], torch.Tensor], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        act.silu_and_mul(make_x())


def test_kernel_compiles_for_sm90(compile_for_sm90) -> None:
    [result] = compile_for_sm90(
        "triton_activation",
        [dict(kernel="_silu_and_mul_kernel", pointer_types={"out_ptr": "*bf16", "x_ptr": "*bf16"},
              constexprs=dict(INTERMEDIATE=1536, BLOCK=1024))],
    )  # fmt: skip
    assert result["stack_bytes"] in (None, 0), result
