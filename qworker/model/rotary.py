"""Rotary position embeddings: one table of cos/sin per RopeTable, with longrope's second table
and a partial rotary dimension where the family has them."""

from __future__ import annotations

import torch
from torch import nn

from qworker.model.config import RopeTable
from qworker.model.ops import TORCH_OPS, ModelOps, apply_rotary_torch


def _cos_sin(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq.float())
    # [max_positions, rotary_dim // 2]
    return freqs.cos() * scaling, freqs.sin() * scaling


class RotaryEmbedding(nn.Module):
    # [max_positions (twice that with longrope), rotary_dim // 2] float32
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, table: RopeTable, head_dim: int, max_positions: int, ops: ModelOps = TORCH_OPS
    ) -> None:
        super().__init__()
        self.ops = ops
        self.rotary_dim = 2 * table.inv_freq.shape[0]
        assert self.rotary_dim <= head_dim, f"rotary dim {self.rotary_dim} exceeds head dim {head_dim}"
        self.max_positions = max_positions
        cos, sin = _cos_sin(table.inv_freq, table.attention_scaling, max_positions)
        self.original_max_position_embeddings = table.original_max_position_embeddings
        if table.long_inv_freq is not None:
            # Rows [max_positions, 2 * max_positions) hold the long factors' table.
            long_cos, long_sin = _cos_sin(table.long_inv_freq, table.attention_scaling, max_positions)
            cos, sin = torch.cat([cos, long_cos]), torch.cat([sin, long_sin])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def has_long_table(self) -> bool:
        return self.original_max_position_embeddings is not None

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        token_seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], positions: [T]; rotate-half convention of HF Llama.

        With longrope, `token_seq_lens` [T] is the context length of each token's sequence in this
        step: as transformers, a sequence past the original context takes the long factors.
        """
        if self.original_max_position_embeddings is not None:
            assert token_seq_lens is not None, "longrope needs each token's sequence length"
            is_long = token_seq_lens > self.original_max_position_embeddings
            positions = positions + is_long.to(positions.dtype) * self.max_positions
        if self.rotary_dim == q.shape[-1]:
            return self.ops.apply_rotary(q, k, positions, self.cos, self.sin)
        # Partial rotary (Phi-4-mini): rotate the first rotary_dim of each head, pass the rest.
        dim = self.rotary_dim
        q_rot, k_rot = apply_rotary_torch(q[..., :dim], k[..., :dim], positions, self.cos, self.sin)
        return torch.cat([q_rot, q[..., dim:]], dim=-1), torch.cat([k_rot, k[..., dim:]], dim=-1)
