"""Int8Linear (W8A8) against a float64 reference of the same quantized math: exact int32 sums
(the AVX2 saturation case included), zero rows, fp32 and bf16, and the option's refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qworker.cli_options import config_option_list, config_to_args
from qworker.config import EngineConfig, QuantizationMethod
from qworker.quantization.int8_linear import (
    ACTIVATIONS_7_BIT,
    ACTIVATIONS_8_BIT,
    Int8Linear,
    cpu_activation_format,
    cpu_has_int8_dot,
    has_onednn_int8,
    quantize_rows,
    quantize_weight,
)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not has_onednn_int8(), reason="this torch has no oneDNN int8 matmul"),
]


def reference(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's math in float64 from exact int64 sums, with the CPU's activation format."""
    levels, x_scale = quantize_rows(x, cpu_activation_format().levels)
    acc = (levels.to(torch.int64) @ layer.weight.to(torch.int64).T).double()
    out = acc * x_scale.double() * layer.weight_scale.double()[None, :]
    if layer.bias is not None:
        out = out + layer.bias.double()
    return out


def random_layer(n: int, k: int, *, bias: bool, seed: int) -> tuple[nn.Linear, Int8Linear]:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    return linear, Int8Linear.from_float(linear)


def test_the_activation_format_follows_the_cpu() -> None:
    # Without VNNI, vpmaddubsw's int16 pairs would saturate on 8-bit activations (module docstring).
    expected = ACTIVATIONS_8_BIT if cpu_has_int8_dot() else ACTIVATIONS_7_BIT
    assert cpu_activation_format() == expected


@pytest.mark.parametrize(
    ("rows", "n", "k", "bias"), [(1, 48, 64, False), (7, 70, 96, True), (33, 128, 200, True)]
)
def test_fp32_matches_the_float64_reference(rows: int, n: int, k: int, bias: bool) -> None:
    linear, layer = random_layer(n, k, bias=bias, seed=rows)
    x = torch.randn(rows, k) * 3
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    # fp32 rounding of the scaled sums only: the integers are exact.
    torch.testing.assert_close(out.double(), reference(layer, x), rtol=1e-6, atol=1e-6)
    # And it is a linear layer: close to the float one (the quantization error, 7 or 8 bits).
    error = (out - linear(x)).abs().max() / linear(x).abs().max()
    assert error < 0.05


@pytest.mark.parametrize("weight_value", [127, -128])
def test_int32_sums_are_exact_at_the_extremes(weight_value: int) -> None:
    # Every activation at the largest level and every weight at an end of int8: the pattern whose
    # u8 x s8 pairs saturate vpmaddubsw's int16 with 8-bit activations on AVX2.
    k, n = 1536, 32
    layer = Int8Linear(torch.full((n, k), weight_value, dtype=torch.int8), torch.ones(n))
    levels = cpu_activation_format().levels
    x = torch.full((3, k), float(levels))
    x[1] = -levels
    x[2, ::2] = -levels
    sums = x.to(torch.int64) @ layer.weight.to(torch.int64).T
    # x_scale is 1 (amax = levels) and |sums| < 2**24: the fp32 output holds the integers exactly.
    assert torch.equal(layer(x).to(torch.int64), sums)


def test_random_int32_sums_are_exact() -> None:
    k, n = 512, 64
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    layer = Int8Linear(weight, torch.ones(n))
    levels = cpu_activation_format().levels
    x = torch.randint(-levels, levels + 1, (9, k), generator=gen).float()
    x[:, 0] = levels  # amax = levels in every row: x_scale 1
    assert torch.equal(layer(x).to(torch.int64), x.to(torch.int64) @ weight.to(torch.int64).T)


def test_zero_rows_give_the_bias() -> None:
    _, layer = random_layer(40, 64, bias=True, seed=1)
    x = torch.randn(4, 64)
    x[1] = 0
    x[3] = 0
    out = layer(x)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], layer.bias.detach()) and torch.equal(out[3], layer.bias.detach())
    torch.testing.assert_close(out.double(), reference(layer, x), rtol=1e-6, atol=1e-6)


def test_bf16_in_bf16_out() -> None:
    _, layer = random_layer(96, 128, bias=True, seed=2)
    layer = layer.to(torch.bfloat16)
    # The model's dtype moves the bias only: the integers and their scales stay as they were.
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
    assert layer.bias is not None and layer.bias.dtype == torch.bfloat16
    x = (torch.randn(5, 128) * 2).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    # Quantized from the bf16 values themselves, one rounding to bf16 at the end.
    torch.testing.assert_close(out.double(), reference(layer, x), rtol=8e-3, atol=1e-6)


def test_3d_input_keeps_its_leading_shape() -> None:
    _, layer = random_layer(16, 32, bias=False, seed=4)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(layer(x), layer(x.reshape(6, 32)).view(2, 3, 16))


def test_weight_quantization_is_symmetric_per_channel() -> None:
    weight = torch.randn(8, 64)
    weight[2] = 0
    wq, scale = quantize_weight(weight)
    assert wq.dtype == torch.int8 and scale.shape == (8,)
    amax = weight.abs().amax(1)
    torch.testing.assert_close(scale[amax > 0], amax[amax > 0] / 127.5)
    assert (wq[2] == 0).all() and scale[2] > 0
    # Each row's largest magnitude lands on an end of int8.
    assert bool((wq.to(torch.int16).abs().amax(1)[amax > 0] >= 127).all())


def test_the_option_takes_none_or_int8() -> None:
    assert EngineConfig().quantization is None
    assert EngineConfig(quantization="int8").quantization == QuantizationMethod.INT8 == "int8"
    assert EngineConfig(quantization="none").quantization is None
    with pytest.raises(ValueError, match=r"quantization must be none or int8 \(W8A8\), got 'fp8'") as err:
        EngineConfig(quantization="fp8")
    assert "\n" not in str(err.value)
    option = {o.field_name: o for o in config_option_list(EngineConfig)}["quantization"]
    assert option.flag == "--quantization" and option.is_optional
    assert config_to_args(EngineConfig(quantization="int8")) == ["--quantization", "int8"]
    assert "--quantization" not in config_to_args(EngineConfig())
