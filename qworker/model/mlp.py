"""The gated MLP (SwiGLU or GeGLU) with gate and up fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model.config import Activation
from qworker.model.linear import Linear
from qworker.model.ops import TORCH_OPS, ModelOps


def gated_activation(x: torch.Tensor, activation: Activation, ops: ModelOps) -> torch.Tensor:
    """x: [T, 2 * I] (gate, then up) -> act(gate) * up: [T, I]."""
    if activation is Activation.SILU:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: Activation, ops: ModelOps = TORCH_OPS
    ) -> None:
        super().__init__()
        self.ops = ops
        self.activation = activation
        # gate and up fused: [hidden] -> [2 * intermediate]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.activation, self.ops))
