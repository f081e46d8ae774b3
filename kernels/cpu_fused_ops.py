"""The model's elementwise ops for the CPU as one-pass C kernels (cpu_fused_ops.c, built at first use
by cpu_build.py), with the launchers that check their inputs.

Each op has the signature and results of its torch reference in qworker.model.ops (transformers'
order of roundings), except that `fused_add_rms_norm` writes x + residual into `residual` itself
and returns it. They run on ``torch.get_num_threads()`` OpenMP threads for large inputs.

Measured on the 2-core AVX-512 EPYC, bf16, per call against the torch reference: see
docs/BENCHMARKS.md (CPU engine against vLLM's CPU build).
"""

from __future__ import annotations

import ctypes

import torch
from qworker_kernels.cpu_build import CKernelLibrary

__all__ = [
    "argmax_rows",
    "built_with_avx512",
    "fused_add_rms_norm",
    "is_available",
    "rms_norm",
    "rotary",
    "silu_and_mul",
]

_DTYPES = (torch.float32, torch.bfloat16)
_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_LIBRARY = CKernelLibrary(
    "cpu_fused_ops.c",
    {
        "qw_rms_norm": [_P, _I64, _P, _P, _P, _I64, _I64, _F, _I, _I, _I],
        "qw_rotary": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I, _I],
        "qw_silu_and_mul": [_P, _I64, _P, _I64, _I64, _I, _I],
        "qw_argmax_rows": [_P, _I64, _I64, _I64, _I, _P, _I],
        "qw_fused_ops_avx512": [],
    },
    errors={1: (ValueError, "a position is outside the rotary tables")},
    # No FMA contraction: a * b - c * d must round as torch rounds it.
    extra_flags=("-ffp-contract=off",),
)


def is_available() -> bool:
    """True when the C kernels are built (or can be built now) and loaded."""
    return _LIBRARY.is_available()


def built_with_avx512() -> bool:
    """True when the library was built for a CPU with AVX-512 (one register per 16-lane vector).
    Elsewhere `argmax_rows` is slower than torch.argmax (see qw_fused_ops_avx512)."""
    return bool(_lib().qw_fused_ops_avx512())


def _lib() -> ctypes.CDLL:
    return _LIBRARY.require()


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype, width: int) -> None:
    """t: [rows, width] with packed rows (any row stride), on the CPU, in dtype."""
    if t.device.type != "cpu" or t.dtype != dtype:
        raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.device} {t.dtype}")
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1 or t.stride(0) < width:
        raise ValueError(
            f"{name} must be [rows, {width}] with packed rows, got {tuple(t.shape)} {t.stride()}"
        )


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> int:
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype must be one of {_DTYPES}, got {x.dtype}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(
            f"weight must be contiguous [{hidden}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    return hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> rms_norm(x) * weight, a new tensor."""
    hidden = _check_weight(x, weight)
    x2 = x.reshape(-1, hidden)
    _check_rows("x", x2, x.dtype, hidden)
    out = torch.empty(x2.shape, dtype=x.dtype)
    _lib().qw_rms_norm(
        x2.data_ptr(), x2.stride(0), None, weight.data_ptr(), out.data_ptr(), x2.shape[0], hidden,
        eps, 0, int(x.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); the sum is written into `residual`."""
    hidden = _check_weight(x, weight)
    x2 = x.reshape(-1, hidden)
    _check_rows("x", x2, x.dtype, hidden)
    if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(
            f"residual must be contiguous {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)}"
        )
    out = torch.empty(x2.shape, dtype=x.dtype)
    _lib().qw_rms_norm(
        x2.data_ptr(), x2.stride(0), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x2.shape[0],
        hidden, eps, 1, int(x.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    return out.view(x.shape), residual


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D] (heads packed within a row; rows may be strided, as views into
    the qkv matmul's output), positions [T] int64, cos/sin [max_positions, D // 2] fp32 -> new
    packed (q, k) rotated by the rotate-half convention of HF Llama."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, H, D] and k [T, KVH, D] expected, got {tuple(q.shape)} and {tuple(k.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    _check_rows("q", q.view(num_tokens, -1) if q.stride(1) == head_dim else q, q.dtype, num_heads * head_dim)
    _check_rows(
        "k", k.view(num_tokens, -1) if k.stride(1) == head_dim else k, q.dtype, num_kv_heads * head_dim
    )
    if positions.dtype != torch.int64 or positions.shape != (num_tokens,) or not positions.is_contiguous():
        raise ValueError(f"positions must be contiguous int64 [{num_tokens}], got {positions.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != head_dim // 2:
            raise ValueError(
                f"{name} must be fp32 [max_positions, {head_dim // 2}], got {tuple(table.shape)}"
            )
        if not table.is_contiguous() or table.shape != cos.shape:
            raise ValueError(f"{name} must be contiguous and shaped like cos")
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=q.dtype)
    rc = _lib().qw_rotary(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), cos.shape[0], q_out.data_ptr(), k_out.data_ptr(), num_tokens, num_heads,
        num_kv_heads, head_dim, int(q.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"rotary: a position is outside [0, {cos.shape[0]})")
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (gate, then up) -> silu(gate) * up [T, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, 2 * I] fp32 or bf16, got {tuple(x.shape)} {x.dtype}")
    _check_rows("x", x, x.dtype, x.shape[1])
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype)
    _lib().qw_silu_and_mul(
        x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], inter, int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] fp32 or bf16 (packed rows, any row stride) -> [N] int64, the index of each
    row's largest value as torch.argmax(dim=-1) picks it: the first of equal maxima, the first NaN
    of a row holding one."""
    # The kernel counts indices in int32 lanes.
    if logits.dim() != 2 or logits.dtype not in _DTYPES or not 0 < logits.shape[1] < 2**31:
        raise ValueError(
            f"logits must be [N, vocab > 0] fp32 or bf16, got {tuple(logits.shape)} {logits.dtype}"
        )
    _check_rows("logits", logits, logits.dtype, logits.shape[1])
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _lib().qw_argmax_rows(
        logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
        int(logits.dtype == torch.bfloat16), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out
