"""RMSNorm in the two kinds the families use (see NormKind)."""

from __future__ import annotations

import torch
from torch import nn

from qworker.model.config import NormKind
from qworker.model.ops import TORCH_OPS, ModelOps


def rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' GemmaRMSNorm: (x * w).to(dtype) in fp32, where Llama does x.to(dtype) * w.
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, kind: NormKind = NormKind.RMS, ops: ModelOps = TORCH_OPS
    ) -> None:
        super().__init__()
        # Gemma stores weight - 1 (zeros is the identity), Llama the weight itself.
        initial = torch.zeros(hidden_size) if kind is NormKind.RMS_PLUS_ONE else torch.ones(hidden_size)
        self.weight = nn.Parameter(initial)
        self.eps = eps
        self.kind = kind
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is NormKind.RMS_PLUS_ONE:
            return rms_norm_plus_one(x, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        if self.kind is NormKind.RMS_PLUS_ONE:
            total = x + residual
            return rms_norm_plus_one(total, self.weight, self.eps), total
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
