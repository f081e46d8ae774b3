"""The model's elementwise ops, chosen once when the runner builds the model: plain torch
(token-exact with transformers), the one-pass C kernels of `qworker_kernels.cpu_fused_ops` (CPU
tensors, the torch attention backend: the same roundings as the torch ops, the RMSNorm bit for
bit, but for the last bit of SiLU's exp), or the fused Triton kernels (with the Triton attention
backend, i.e. on CUDA, or on CPU under TRITON_INTERPRET=1 for tests).

The model calls `ops.<name>(...)` and never branches on the device per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from qworker_kernels.rmsnorm_reference import fused_add_rms_norm_reference, rms_norm_reference

from qworker import envs


@dataclass(frozen=True)
class ModelOps:
    """One implementation of each op; both sets have the same signatures and return values."""

    name: str
    # (x [..., hidden], weight [hidden], eps) -> [..., hidden]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual); the C and Triton ops
    # write x + residual into residual's storage.
    fused_add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    # (q [T, H, D], k [T, KVH, D], positions [T] int64, cos, sin [max_pos, D // 2] fp32) -> (q, k)
    # rotated; the Triton op rotates in place, the torch and C ops return new packed tensors.
    apply_rotary: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        tuple[torch.Tensor, torch.Tensor],
    ]
    # x [T, 2 * I] (gate, then up) -> silu(gate) * up [T, I]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


def apply_rotary_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # Rotate-half convention of HF Llama, in the model dtype as transformers does it.
    cos_t = cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D // 2]
    sin_t = sin[positions].to(q.dtype).unsqueeze(1)
    return _rotate(q, cos_t, sin_t), _rotate(k, cos_t, sin_t)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


TORCH_OPS = ModelOps(
    name="torch",
    # Same order of operations as transformers' LlamaRMSNorm, for token-exact parity.
    rms_norm=rms_norm_reference,
    fused_add_rms_norm=fused_add_rms_norm_reference,
    apply_rotary=apply_rotary_torch,
    silu_and_mul=silu_and_mul_torch,
)


def triton_ops() -> ModelOps:
    """The fused Triton kernels. Imported here, not at module load: triton reads TRITON_INTERPRET
    when the kernels are decorated, and CPU-only installs need not have triton at all."""
    from qworker_kernels.triton_activation import silu_and_mul
    from qworker_kernels.triton_rmsnorm import fused_add_rms_norm, rms_norm
    from qworker_kernels.triton_rotary import apply_rotary

    return ModelOps(
        name="triton",
        rms_norm=rms_norm,
        fused_add_rms_norm=fused_add_rms_norm,
        apply_rotary=apply_rotary,
        silu_and_mul=silu_and_mul,
    )


def cpu_ops() -> ModelOps | None:
    """The one-pass C kernels; None where they cannot be built or QWORKER_DISABLE_CPU_KERNEL is set.

    They work on 32-element blocks (bf16 widened and rounded by integer shifts): SiLU-and-mul is
    1.5x torch's ops at 128 rows and 4.0x at 2,048 (one thread, bf16, SmolLM2 shapes, the AMX
    Xeon), and each op about 2x the earlier 8-lane code (`scripts/bench_cpu_elementwise.py`).
    """
    if envs.QWORKER_DISABLE_CPU_KERNEL.get():
        return None
    from qworker_kernels import cpu_fused_ops

    if not cpu_fused_ops.is_available():
        return None
    return ModelOps(
        name="cpu",
        rms_norm=cpu_fused_ops.rms_norm,
        fused_add_rms_norm=cpu_fused_ops.fused_add_rms_norm,
        apply_rotary=cpu_fused_ops.rotary,
        silu_and_mul=cpu_fused_ops.silu_and_mul,
    )


def select_model_ops(attention_backend_name: str, device: torch.device | None = None) -> ModelOps:
    """Triton ops go with the Triton attention backend (CUDA, or the interpreter); the C ops with
    the torch backend on the CPU; torch otherwise."""
    if attention_backend_name == "triton":
        return triton_ops()
    if device is not None and device.type == "cpu":
        return cpu_ops() or TORCH_OPS
    return TORCH_OPS
