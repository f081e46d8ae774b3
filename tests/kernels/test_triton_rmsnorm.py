# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
import pytest
import qworker_kernels.triton_rmsnorm as rn
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(60)

# Kernel and reference round at the same two points (normed -> dtype, product -> dtype); what is left
# is the fp32 summation order, which can flip a rounding: one ulp of the output dtype.
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}
EPS = 1e-6


def hf_llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm.forward, copied so the test checks the contract, not our reference.
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


CASES = [
    ((1, 1), torch.float32),
    ((7, 576), torch.float32),  # SmolLM2-135M hidden size
    ((5, 1000), torch.bfloat16),  # not a power of two
    ((2, 3, 64), torch.float16),  # leading dims flattened (q/k norms per head)
    ((4, 2048), torch.bfloat16),  # wider rows: more warps
]


def assert_same_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The residual add must round to the dtype exactly as `x + residual` does (round to nearest
    even). Triton's interpreter truncates fp32 -> bf16 casts instead, so there only within one ulp."""
    if actual.dtype == torch.bfloat16 and actual.device.type == "cpu":
        torch.testing.assert_close(actual, expected, atol=0.0, rtol=2.0**-7)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_rms_norm_matches_hf(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape, device=DEVICE) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).to(dtype)
    out = rn.rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, hf_llama_rms_norm(x, weight, EPS), **TOLERANCE[dtype])
    torch.testing.assert_close(out, rn.rms_norm_reference(x, weight, EPS), **TOLERANCE[dtype])


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_fused_add_rms_norm_matches_unfused(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, device=DEVICE).to(dtype)
    residual = (torch.randn(shape, device=DEVICE) * 5).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = rn.fused_add_rms_norm(x, residual, weight, EPS)
    assert_same_rounding(residual_out, x + residual)
    torch.testing.assert_close(out, hf_llama_rms_norm(x + residual, weight, EPS), **TOLERANCE[dtype])
    ref_out, ref_residual = rn.fused_add_rms_norm_reference(x, residual, weight, EPS)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert_same_rounding(residual_out, ref_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were modified"


def test_rms_norm_row_strided_input() -> None:
    buffer = torch.randn((6, 100), device=DEVICE)
    x = buffer[::2, :64]  # rows 200 elements apart
    weight = torch.randn(64, device=DEVICE)
    torch.testing.assert_close(rn.rms_norm(x, weight, EPS), hf_llama_rms_norm(x, weight, EPS))
    out, residual_out = rn.fused_add_rms_norm(x, x, weight, EPS)
    torch.testing.assert_close(residual_out, 2 * x)
    torch.testing.assert_close(out, hf_llama_rms_norm(2 * x, weight, EPS))


def test_rms_norm_zero_row_uses_eps() -> None:
    x = torch.zeros((2, 32), device=DEVICE)
    out = rn.rms_norm(x, torch.ones(32, device=DEVICE), 1e-5)
    assert torch.equal(out, torch.zeros_like(x))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(rows=st.integers(1, 4), hidden=st.integers(1, 700), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_rms_norm_property_shapes_and_scales(rows: int, hidden: int, scale: float) -> None:
    x = torch.randn((rows, hidden), device=DEVICE) * scale
    weight = torch.randn(hidden, device=DEVICE)
    torch.testing.assert_close(
        rn.rms_norm(x, weight, EPS), hf_llama_rms_norm(x, weight, EPS), atol=1e-5, rtol=1e-4
    )


def test_empty_input() -> None:
    x = torch.empty((0, 16), device=DEVICE)
    assert rn.rms_norm(x, torch.ones(16, device=DEVICE), EPS).shape == (0, 16)
    out, residual_out = rn.fused_add_rms_norm(x, x, torch.ones(16, device=DEVICE), EPS)
    assert out.shape == residual_out.shape == (0, 16)


def _bad_inputs() -> dict[str, tuple[tuple, str]]:
    x = torch.randn((3, 16), device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    return {
        "weight_shape": ((x, torch.ones(8, device=DEVICE), EPS), "weight must be"),
        "weight_dtype": ((x, w.half(), EPS), "weight dtype"),
        "int_dtype": ((x.int(), w.int(), EPS), "dtype must be one of"),
        "strided_last_dim": ((torch.randn((3, 32), device=DEVICE)[:, ::2], w, EPS), "contiguous"),
        "negative_eps": ((x, w, -1.0), "eps"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_rms_norm_rejects_bad_input(name: str) -> None:
    args, message = _bad_inputs()[name]
    with pytest.raises(ValueError, match=message):
        rn.rms_norm(*args)
    x, weight, eps = args
    with pytest.raises(ValueError, match=message):
        rn.fused_add_rms_norm(x, x, weight, eps)


def test_fused_add_rms_norm_rejects_mismatched_residual() -> None:
    x = torch.randn((3, 16), device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="residual must match"):
        rn.fused_add_rms_norm(x, x[:2], w, EPS)
    with pytest.raises(ValueError, match="residual must match"):
        rn.fused_add_rms_norm(x, x.half(), w, EPS)


def test_kernels_compile_for_sm90(compile_for_sm90) -> None:
    pointers = {
        "out_ptr": "*bf16", "residual_out_ptr": "*bf16", "x_ptr": "*bf16", "residual_ptr": "*bf16",
        "weight_ptr": "*bf16",
    }  # fmt: skip
    results = compile_for_sm90(
        "triton_rmsnorm",
        [
            dict(kernel="_rms_norm_kernel", pointer_types=pointers, float_args=["eps"],
                 constexprs=dict(HIDDEN=4096, BLOCK=4096), num_warps=8),
            dict(kernel="_fused_add_rms_norm_kernel", pointer_types=pointers, float_args=["eps"],
                 constexprs=dict(HIDDEN=8192, BLOCK=8192), num_warps=16),
        ],
    )  # fmt: skip
    for result in results:
        assert result["stack_bytes"] in (None, 0), result
