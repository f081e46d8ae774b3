"""Sparse mixture of experts: a router picks top-k experts per token; the experts' weights are
stacked, [E, 2 * I, H] for gate and up (gate first) and [E, H, I] for down, the layout of
transformers 5 and of the Triton fused-MoE kernel.

On the CPU the tokens are grouped by expert: one sort, then one matmul pair per expert that has
tokens (never a loop over tokens). On CUDA, `qworker_kernels.triton_fused_moe.fused_moe` runs
all experts in one kernel when it is importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qworker.model.config import Activation, MoeConfig
from qworker.model.linear import Linear, PackedWeight, is_packing_available
from qworker.model.mlp import gated_activation
from qworker.model.ops import TORCH_OPS, ModelOps

FusedMoe = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def load_fused_moe() -> FusedMoe | None:
    """The Triton fused-MoE kernel, or None where it is not there (yet)."""
    try:
        from qworker_kernels.triton_fused_moe import fused_moe
    except ImportError:
        return None
    return fused_moe  # type: ignore[no-any-return]


def route(
    router_logits: torch.Tensor, config: MoeConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (weights [T, K], expert ids [T, K] int64): softmax over all
    experts in float32, top-k, renormalised when `norm_topk_prob`, as transformers routes."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, config.top_k, dim=-1)
    if config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if config.is_routing_weight_in_model_dtype:
        weights = weights.to(dtype)
    return weights, expert_ids


def grouped_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    activation: Activation,
    ops: ModelOps,
    packed: tuple[list[PackedWeight], list[PackedWeight]] | None = None,
) -> torch.Tensor:
    """x: [T, H], w_gate_up: [E, 2I, H], w_down: [E, H, I], weights/expert_ids: [T, K] -> [T, H].

    The (token, expert) pairs are sorted by expert; each expert with tokens runs one matmul pair
    over its rows (through `packed`, per-expert packed copies of the weights, when given). Each
    token's K outputs are then summed in ascending expert order, the order of transformers' loop
    (its index_add_ into zeros rounds the same way), without index_add_: in bf16 on the CPU that
    took a quarter of a tiny MoE's step."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # [T * K] pair indices, grouped by expert
    token_of_pair = order // top_k
    sorted_weights = weights.reshape(-1)[order]
    counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()
    gathered = x[token_of_pair]  # [T * K, H]
    pair_out = torch.empty_like(gathered)  # [T * K, H], in expert order
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        if packed is None:
            gate_up = F.linear(gathered[rows], w_gate_up[expert])
        else:
            gate_up = packed[0][expert].linear(gathered[rows], w_gate_up[expert])
        hidden = gated_activation(gate_up, activation, ops)
        if packed is None:
            down = F.linear(hidden, w_down[expert])
        else:
            down = packed[1][expert].linear(hidden, w_down[expert])
        pair_out[rows] = (down * sorted_weights[rows, None]).to(x.dtype)
        start += count
    # Back to [T, K, H] by pair, then each token's K slots in ascending expert id.
    by_pair = torch.empty_like(pair_out)
    by_pair[order] = pair_out
    by_expert = by_pair.view(num_tokens, top_k, -1).gather(
        1, torch.argsort(expert_ids, dim=1)[:, :, None].expand(-1, -1, x.shape[1])
    )
    out = by_expert[:, 0]
    for k in range(1, top_k):
        out = out + by_expert[:, k]
    return out


class Experts(nn.Module):
    def __init__(self, hidden_size: int, config: MoeConfig) -> None:
        super().__init__()
        size, num = config.intermediate_size, config.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num, hidden_size, size))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        # Per expert, the CPU's packed copy of its weights (see qworker.model.linear).
        is_packed = is_packing_available()
        self.packed = (
            [PackedWeight(is_packed) for _ in range(num)],
            [PackedWeight(is_packed) for _ in range(num)],
        )


class SparseMoe(nn.Module):
    def __init__(
        self, hidden_size: int, config: MoeConfig, activation: Activation, ops: ModelOps = TORCH_OPS
    ) -> None:
        super().__init__()
        self.config = config
        self.activation = activation
        self.ops = ops
        # The router, unpacked: the same F.linear as transformers, so that near-ties route alike.
        self.gate = Linear(hidden_size, config.num_experts, bias=False, pack=False)
        self.experts = Experts(hidden_size, config)
        # Looked up at the first CUDA forward, not here: importing the kernel decorates it, and
        # triton reads TRITON_INTERPRET then. SiLU only: the kernel computes silu(gate) * up.
        self._fused_moe: FusedMoe | None = None
        self._is_fused_moe_looked_up = activation is not Activation.SILU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = route(self.gate(x), self.config, x.dtype)
        if x.is_cuda and not self._is_fused_moe_looked_up:
            self._fused_moe = load_fused_moe()
            self._is_fused_moe_looked_up = True
        if self._fused_moe is not None and x.is_cuda:
            return self._fused_moe(
                x, self.experts.gate_up_proj, self.experts.down_proj, weights.float(), expert_ids
            )
        return grouped_experts(
            x,
            self.experts.gate_up_proj,
            self.experts.down_proj,
            weights,
            expert_ids,
            self.activation,
            self.ops,
            self.experts.packed,
        )
