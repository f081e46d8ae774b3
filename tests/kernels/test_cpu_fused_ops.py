"""The CPU fused elementwise kernels against the model's torch ops (transformers' roundings): odd row
counts and widths, strided rows, both dtypes, one and two threads."""

from __future__ import annotations

import platform

import pytest
import torch
from qworker_kernels import cpu_fused_ops
from qworker_kernels.cpu_build import CKernelLibrary
from qworker_kernels.rmsnorm_reference import fused_add_rms_norm_reference, rms_norm_reference
from qworker_kernels.testing import cpu_flags

from qworker.model.ops import apply_rotary_torch, silu_and_mul_torch

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not cpu_fused_ops.is_available(), reason="no C compiler to build the CPU kernels"),
]

DTYPES = [torch.float32, torch.bfloat16]


def assert_close_ulps(got: torch.Tensor, want: torch.Tensor, max_ulps: int, max_share: float) -> None:
    """bf16: at most `max_share` of the elements differ, each by at most `max_ulps` units in the last
    place. fp32: within a few ulps (relative 1e-6), wherever the last bits go."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    diff = (got.contiguous().view(torch.int16).long() - want.contiguous().view(torch.int16).long()).abs()
    assert int(diff.max()) <= max_ulps, f"max {int(diff.max())} ulps"
    assert (diff > 0).float().mean().item() <= max_share, f"{(diff > 0).float().mean().item():.4f} differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "hidden"),
    # SmolLM2's widths (576, 960), the 1.7B models' (2048), a 4,096 and a 5,120 one (the sum of
    # squares' cascade carries at 16, 32 and 64 blocks), tails of leftover vectors and scalars.
    [(1, 576), (7, 48), (300, 576), (130, 100), (64, 960), (40, 2048), (16, 4096), (8, 5120), (33, 31)],
)
def test_rms_norm_and_fused_add_match_torch_bit_for_bit(dtype, rows, hidden, threads):
    # The sum of squares is added in the order of torch's sum kernel, so the variance, and with it
    # every output, has torch's bits; rows of very different scales exercise the last bit.
    gen = torch.Generator().manual_seed(rows * hidden)
    scale = torch.rand(rows, 1, generator=gen) * 8 + 0.01
    x = (torch.randn(rows, hidden, generator=gen) * scale).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    assert torch.equal(cpu_fused_ops.rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    want_normed, want_sum = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    normed, summed = cpu_fused_ops.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    assert torch.equal(summed, want_sum)
    assert torch.equal(normed, want_normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_rows(dtype):
    # x: every other row of a wider tensor, as a view.
    base = torch.randn(9, 2, 64).to(dtype)
    x = base[:, 0]
    weight = torch.rand(64).to(dtype)
    assert torch.equal(cpu_fused_ops.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"),
    [(1, 9, 3, 64), (37, 4, 4, 16), (200, 9, 3, 64), (5, 2, 1, 80), (9, 2, 2, 128)],
)
def test_rotary_matches_torch_exactly_from_qkv_views(dtype, tokens, heads, kv_heads, head_dim, threads):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    max_positions = 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, max_positions, (tokens,), generator=gen)
    want_q, want_k = apply_rotary_torch(q, k, positions, cos, sin)
    got_q, got_k = cpu_fused_ops.rotary(q, k, positions, cos, sin)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)


def test_rotary_rejects_a_position_past_the_table():
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    table = torch.randn(16, 4)
    with pytest.raises(ValueError, match="position"):
        cpu_fused_ops.rotary(q, k, torch.tensor([0, 16]), table, table)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 1536), (33, 40), (256, 1536)])
def test_silu_and_mul(dtype, tokens, inter, threads):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    # Extremes too: exp overflows and underflows at either end.
    x[0, :4] = torch.tensor([-120.0, -88.5, 90.0, 0.0]).to(dtype)
    want = silu_and_mul_torch(x)
    got = cpu_fused_ops.silu_and_mul(x)
    # exp differs from torch's by an ulp or two: rarely visible after rounding to bf16.
    share = 0.01 if dtype == torch.bfloat16 else 0.5
    assert_close_ulps(got, want, 4 if dtype == torch.float32 else 1, share)


def test_launchers_reject_bad_inputs():
    with pytest.raises(ValueError):
        cpu_fused_ops.rms_norm(
            torch.randn(4, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-6
        )
    with pytest.raises(ValueError):
        cpu_fused_ops.rms_norm(torch.randn(4, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError):
        cpu_fused_ops.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError):
        cpu_fused_ops.fused_add_rms_norm(torch.randn(4, 8), torch.randn(8, 4).t(), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_nan_and_inf_keep_torch_values(dtype):
    # The vector rounding has no NaN case of its own: a NaN must still come out NaN, and inf as inf.
    x = torch.randn(4, 576).to(dtype)
    x[0, 3], x[1, 40], x[2, 575] = float("nan"), float("inf"), float("-inf")
    weight = (torch.rand(576) + 0.5).to(dtype)
    got, want = cpu_fused_ops.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[3], want[3])
    gate_up = torch.randn(3, 2 * 64).to(dtype)
    gate_up[0, 5], gate_up[1, 64 + 7], gate_up[2, 9] = float("nan"), float("inf"), float("-inf")
    got, want = cpu_fused_ops.silu_and_mul(gate_up), silu_and_mul_torch(gate_up)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 31), (5, 33), (64, 1000), (130, 49152)])
def test_argmax_rows_picks_as_torch_does(dtype, rows, vocab, threads):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    assert torch.equal(cpu_fused_ops.argmax_rows(logits), logits.argmax(dim=-1))
    # Many equal maxima: the first wins, wherever it falls in the kernel's lanes.
    ties = (logits * 2).round().clamp(max=2.0)
    assert torch.equal(cpu_fused_ops.argmax_rows(ties), ties.argmax(dim=-1))
    special = logits.clone()
    special[0] = float("-inf")  # a row masked out entirely: index 0
    if rows > 1:
        special[1, -1] = float("nan")  # a NaN beats everything, even an inf before it
        special[1, 0] = float("inf")
    if rows > 2:
        special[2, vocab // 2] = float("inf")
        special[2, vocab - 1] = float("inf")
    assert torch.equal(cpu_fused_ops.argmax_rows(special), special.argmax(dim=-1))


def test_argmax_rows_of_strided_rows_and_bad_inputs():
    base = torch.randn(6, 2, 300)
    view = base[:, 1]
    assert torch.equal(cpu_fused_ops.argmax_rows(view), view.argmax(dim=-1))
    with pytest.raises(ValueError):
        cpu_fused_ops.argmax_rows(torch.randn(4, 8).t())
    with pytest.raises(ValueError):
        cpu_fused_ops.argmax_rows(torch.randn(4, 0))
    with pytest.raises(ValueError):
        cpu_fused_ops.argmax_rows(torch.randn(8, dtype=torch.float16))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
def test_the_sampler_takes_the_c_argmax_only_from_an_avx512_build():
    # Built without AVX-512 the argmax loop spills its split vectors and is slower than torch's, so
    # the sampler keeps torch.argmax there; an x86-64-v3 (AVX2) build of the same source says so.
    from qworker.engine import sampler

    assert cpu_fused_ops.built_with_avx512() == ("avx512f" in cpu_flags())
    assert (sampler._cpu_argmax() is not None) == cpu_fused_ops.built_with_avx512()
    avx2 = CKernelLibrary("cpu_fused_ops.c", {"qw_fused_ops_avx512": []}, {}, ("-march=x86-64-v3",))
    if avx2.get() is None:
        pytest.skip("the compiler cannot build -march=x86-64-v3")
    assert avx2.require().qw_fused_ops_avx512() == 0
