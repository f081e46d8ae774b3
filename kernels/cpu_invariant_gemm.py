"""Batch-invariant linear layers for the CPU: a C GEMM (cpu_invariant_gemm.c, built at first use by
cpu_build.py) whose per-output-element reduction over K runs in one fixed order whatever the number
of rows, so a row's result does not depend on the rows beside it.

On CPUs with AMX tiles (and an OS that grants them) the bf16 path is TDPBF16PS on 16 x 16 tiles,
32 of K per step, the same chain for every row whatever the row count; with AVX512-BF16 (or
``QWORKER_INVARIANT_GEMM_AMX=0``) VDPBF16PS (pairs of K per step); the fp32 path is AVX-512 FMA;
elsewhere a portable vector-extension path with the same per-lane order (slower). The AMX and
VDPBF16PS paths give different bits from each other, each the same for every row count. Threads:
``torch.get_num_threads()`` OpenMP threads over column and row tiles (no split of K, so the
thread count changes no bit either).

`pack_weight` makes the kernel's layout once; `linear` multiplies by it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from qworker_kernels import envs
from qworker_kernels.cpu_build import CKernelLibrary

__all__ = [
    "PackedInvariantWeight",
    "amx_enabled",
    "is_available",
    "linear",
    "linear_reference",
    "pack_weight",
]

_DTYPES = (torch.float32, torch.bfloat16)
# Output columns per packed block (QW_NB in the C source).
_BLOCK = 16
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LIBRARY = CKernelLibrary(
    "cpu_invariant_gemm.c",
    {
        "qw_inv_amx_available": [_P],
        "qw_inv_pack_bf16": [_P, _I64, _I64, _P, _I],
        "qw_inv_pack_f32": [_P, _I64, _I64, _P],
        "qw_inv_gemm": [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I, _I, _I],
    },
    errors={
        4: (MemoryError, "the C kernel could not allocate its working memory"),
        5: (RuntimeError, "the weight was packed for AMX, which this build or process cannot use"),
    },
    # The portable path's a * b + c must round twice on every build (no FMA contraction).
    extra_flags=("-ffp-contract=off",),
)


def is_available() -> bool:
    """True when the C kernel is built (or can be built now) and loaded."""
    return _LIBRARY.is_available()


@functools.cache
def _amx_available() -> bool:
    flag = ctypes.c_int(0)
    _LIBRARY.require().qw_inv_amx_available(ctypes.byref(flag))
    return bool(flag.value)


def amx_enabled() -> bool:
    """True when bf16 weights are packed for (and multiplied on) AMX tiles: the build targets AMX,
    the OS granted the tile registers, and ``QWORKER_INVARIANT_GEMM_AMX`` is not ``0`` (read at
    each pack, so a test can compare both paths in one process)."""
    if not envs.QWORKER_INVARIANT_GEMM_AMX.get():
        return False
    return _amx_available()


@dataclass(frozen=True)
class PackedInvariantWeight:
    """A weight [out_features, in_features] in the kernel's layout (see cpu_invariant_gemm.c)."""

    data: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype
    amx: bool = False  # packed for the AMX path (K pairs rounded up to 16 per block)


def pack_weight(weight: torch.Tensor) -> PackedInvariantWeight:
    """weight: [N, K] CPU float32 or bfloat16 -> the packed copy."""
    if weight.device.type != "cpu" or weight.dtype not in _DTYPES or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D CPU {_DTYPES} tensor, got {weight.device} {weight.dtype}")
    n, k = weight.shape
    w = weight.detach().contiguous()
    blocks = -(-n // _BLOCK)
    lib = _LIBRARY.require()
    amx = False
    if weight.dtype == torch.bfloat16:
        amx = amx_enabled()
        pairs = -(-k // 2)
        if amx:  # whole 32-element K chunks, one 16-row B tile each
            pairs = -(-pairs // 16) * 16
        data = torch.empty(blocks * pairs * _BLOCK * 2, dtype=torch.bfloat16)
        lib.qw_inv_pack_bf16(w.data_ptr(), n, k, data.data_ptr(), int(amx))
    else:
        data = torch.empty(blocks * k * _BLOCK, dtype=torch.float32)
        lib.qw_inv_pack_f32(w.data_ptr(), n, k, data.data_ptr())
    return PackedInvariantWeight(data, n, k, weight.dtype, amx)


def linear(x: torch.Tensor, packed: PackedInvariantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] in the weight's dtype -> x @ weight.T + bias: [M, N], each row's bits independent
    of M and of the other rows."""
    if x.device.type != "cpu" or x.dtype != packed.dtype or x.dim() != 2 or x.shape[1] != packed.in_features:
        raise ValueError(
            f"x must be a CPU {packed.dtype} [rows, {packed.in_features}] tensor, "
            f"got {x.device} {x.dtype} {tuple(x.shape)}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, packed.out_features), dtype=x.dtype)
    if m == 0:
        return out
    bias_f32 = None if bias is None else bias.detach().float().contiguous()
    status = _LIBRARY.require().qw_inv_gemm(
        x.data_ptr(), x.stride(0), packed.data.data_ptr(),
        None if bias_f32 is None else bias_f32.data_ptr(),
        out.data_ptr(), out.stride(0), m, packed.out_features, packed.in_features,
        int(x.dtype == torch.bfloat16), int(packed.amx), torch.get_num_threads(),
    )  # fmt: skip
    _LIBRARY.check("qw_inv_gemm", status)
    return out


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float64, rounded to x's dtype: what the kernel approximates."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
