"""The model's elementwise ops, chosen once when the runner builds the model: plain torch
(token-exact with transformers, used on CPU) or the fused Triton kernels of `qworker_kernels` (with
the Triton attention backend, i.e. on CUDA, or on CPU under TRITON_INTERPRET=1 for tests).

The model calls `ops.<name>(...)` and never branches on the device per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from qworker_kernels.rmsnorm_reference import fused_add_rms_norm_reference, rms_norm_reference


@dataclass(frozen=True)
class ModelOps:
    """One implementation of each op; both sets have the same signatures and return values."""

    name: str
    # (x [..., hidden], weight [hidden], eps) -> [..., hidden]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    fused_add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    # (q [T, H, D], k [T, KVH, D], positions [T] int64, cos, sin [max_pos, D // 2] fp32) -> (q, k)
    # rotated; the Triton op rotates in place, the torch op returns new tensors.
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


def select_model_ops(attention_backend_name: str) -> ModelOps:
    """Triton ops go with the Triton attention backend (CUDA, or the interpreter); torch otherwise."""
    return triton_ops() if attention_backend_name == "triton" else TORCH_OPS
