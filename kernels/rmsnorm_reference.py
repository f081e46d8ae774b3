"""RMSNorm in plain torch with HF LlamaRMSNorm numerics: the reference of triton_rmsnorm's kernels,
and the op the model runs on its torch backend (token-exact with transformers). No triton here,
so the model can import it on machines without triton."""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm.forward: normalize x.float(), cast back to x's dtype, multiply by weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused: the residual add in the model dtype (as transformers does it), then HF
    LlamaRMSNorm of the rounded sum. Returns (normed, x + residual)."""
    residual_out = x + residual
    return rms_norm_reference(residual_out, weight, eps), residual_out
