"""Int8Linear: a linear layer in W8A8. Weights are int8 with one fp32 scale per output channel
(symmetric, fixed at load); each call quantizes its input rows with one scale per row (per token,
dynamic, symmetric), multiplies int8 by int8 into exact int32 sums, and scales those back:

    out[m, n] = sum_k xq[m, k] * wq[n, k]  *  x_scale[m] * w_scale[n]  (+ bias[n])

The input is read in fp32 (a bf16 input is upcast exactly), the output is rounded once to the
input's dtype. An all-zero row has scale 0 and gives zeros (plus the bias).

CPU: oneDNN's int8 matmul (`torch.ops.onednn.qlinear_pointwise` on a weight packed once by
`qlinear_prepack`), u8 activations with a zero point, s8 weights, int32 accumulation; oneDNN picks
AMX-int8 or AVX512/AVX-VNNI kernels (vpdpbusd: four u8 x s8 products into an int32) where the CPU
has them, and vpmaddubsw-based kernels on AVX2 and AVX-512 without VNNI. vpmaddubsw adds two u8 x s8
products into a saturating int16: with 8-bit activations (up to 255) the pair reaches 255 * 128 * 2
= 65,280 and clips (measured on the AVX2 EPYC: sums off by up to 5e4 on random data). So without
VNNI the activations use 7 bits (-63..63 around zero point 64, u8 0..127): a pair is at most
127 * 128 * 2 = 32,512, and the int32 sums are exact (measured, worst cases included), the
trade fbgemm's reduce_range makes. With VNNI or AMX: 8 bits (-127..127 around 128).

CUDA: activations quantized by torch ops, the product by `qworker_kernels.triton_int8_matmul`
(8-bit activations; int8 tensor cores).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from qworker.errors import InvalidConfigError

# Symmetric int8 weights: scale = amax / 127.5, values rounded and clamped to -128..127, as
# compressed-tensors' min-max quantization computes them (llmcompressor's W8A8 without calibration),
# so that quantizing at load and reading that file give the same integers.
WEIGHT_SCALE_DIVISOR = 127.5
WEIGHT_MIN, WEIGHT_MAX = -128, 127
# CPU flags of the int8 dot-product instructions that accumulate into int32 without saturation.
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@dataclass(frozen=True)
class ActivationFormat:
    """How a CPU call stores its quantized input rows: round(x / scale) + zero_point as u8, with
    scale = amax / levels."""

    levels: int
    zero_point: int


ACTIVATIONS_8_BIT = ActivationFormat(levels=127, zero_point=128)
ACTIVATIONS_7_BIT = ActivationFormat(levels=63, zero_point=64)


@functools.cache
def cpu_has_int8_dot() -> bool:
    """The CPU has VNNI or AMX-int8 (see the module docstring)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in VNNI_FLAGS)


def cpu_activation_format() -> ActivationFormat:
    return ACTIVATIONS_8_BIT if cpu_has_int8_dot() else ACTIVATIONS_7_BIT


def has_onednn_int8() -> bool:
    onednn = getattr(torch.ops, "onednn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(onednn, "qlinear_prepack")
        and hasattr(onednn, "qlinear_pointwise")
    )


def check_int8_device(device: torch.device) -> None:
    """InvalidConfigError, one line, where quantization=int8 cannot run on `device`."""
    if device.type == "cpu":
        if not has_onednn_int8():
            raise InvalidConfigError(
                f"quantization=int8 on the CPU needs oneDNN's int8 matmul (torch.ops.onednn."
                f"qlinear_prepack/qlinear_pointwise), which torch {torch.__version__} here lacks"
            )
        return
    if device.type == "cuda":
        try:
            import qworker_kernels.triton_int8_matmul  # noqa: F401
        except ImportError as exc:
            raise InvalidConfigError(f"quantization=int8 on CUDA needs triton: {exc}") from None
        return
    raise InvalidConfigError(f"quantization=int8 runs on cpu or cuda, not {device}")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, K], fp32 scales [N]), computed in fp32. A zero row gets
    fp32's eps as its scale (compressed-tensors' choice): its integers are zeros either way."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / WEIGHT_SCALE_DIVISOR
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    wq = torch.round(w / scale[:, None]).clamp_(WEIGHT_MIN, WEIGHT_MAX).to(torch.int8)
    return wq, scale


def quantize_rows(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (round(x * levels / amax) in -levels..levels as fp32 [M, K], scale amax / levels
    [M, 1] fp32) per row; a zero row has scale 0 and quantizes to zeros. Few ops on purpose: at
    decode sizes each torch op costs about 10 us of dispatch, more than its arithmetic. No clamp:
    |x| <= amax, so x * fl(levels / amax) is at most levels times (1 + 2 ulp) and rounds to levels."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=1, keepdim=True)
    # A zero row multiplies by levels / 1e-30: its values are zeros either way.
    inverse = torch.reciprocal(amax.clamp_min(1e-30)).mul_(levels)
    return torch.round(x32 * inverse), amax.div_(levels)


class Int8Linear(nn.Module):
    """A W8A8 linear layer (see the module docstring). `weight` is the int8 [out, in] buffer and
    `weight_scale` its fp32 [out] scales, the names compressed-tensors uses; both stay as they are
    when the model moves to another dtype."""

    def __init__(
        self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
            raise ValueError(
                f"an int8 [out, in] weight expected, got {weight_int8.dtype} {tuple(weight_int8.shape)}"
            )
        self.out_features, self.in_features = weight_int8.shape
        if weight_scale.numel() == 1:
            weight_scale = weight_scale.reshape(1).expand(self.out_features)  # one scale per tensor
        if weight_scale.shape != (self.out_features,):
            raise ValueError(
                f"weight_scale of {self.out_features} channels expected, got {tuple(weight_scale.shape)}"
            )
        self.register_buffer("weight", weight_int8.contiguous())
        self.register_buffer("weight_scale", weight_scale.to(torch.float32).contiguous())
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self._packed: torch.Tensor | None = None
        self._packed_key: tuple[int, int] | None = None
        self._zeros: torch.Tensor | None = None

    @classmethod
    def from_float(cls, linear: nn.Module) -> Int8Linear:
        """Quantize a float linear layer's weight at load (no calibration)."""
        weight_int8, scale = quantize_weight(linear.weight)
        return cls(weight_int8, scale, linear.bias)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Module.to(dtype) casts every floating buffer: the scales must stay fp32.
        scale = self.weight_scale
        super()._apply(fn, recurse)
        self.weight_scale = scale.to(self.weight.device, torch.float32)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._forward_cuda(rows) if rows.is_cuda else self._forward_cpu(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def _forward_cpu(self, rows: torch.Tensor) -> torch.Tensor:
        activations = cpu_activation_format()
        key = (self.weight.data_ptr(), self.weight._version)
        if key != self._packed_key:
            self._packed = torch.ops.onednn.qlinear_prepack(self.weight, None)
            self._zeros = torch.zeros(self.out_features, dtype=torch.int64)
            self._packed_key = key
        quantized, x_scale = quantize_rows(rows, activations.levels)
        xq = quantized.add_(activations.zero_point).to(torch.uint8)
        # [M, N] fp32: the int32 sums times the weight scales (input scale 1, output scale 1).
        acc = torch.ops.onednn.qlinear_pointwise(
            xq, 1.0, activations.zero_point, self._packed, self.weight_scale, self._zeros,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        out = acc.mul_(x_scale)
        if self.bias is not None:
            out.add_(self.bias.to(torch.float32))
        return out.to(rows.dtype)

    def _forward_cuda(self, rows: torch.Tensor) -> torch.Tensor:
        from qworker_kernels.triton_int8_matmul import int8_scaled_mm, quantize_rows_int8

        xq, x_scale = quantize_rows_int8(rows)
        return int8_scaled_mm(xq, self.weight, x_scale, self.weight_scale, self.bias, out_dtype=rows.dtype)
