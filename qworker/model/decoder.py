"""The decoder every family builds: attention (fused qkv, optional q/k norms, a per-layer window,
soft-capping), a gated MLP or a sparse MoE, and norms placed before (Llama) or around (Gemma)
each block. Which parts a model has is its ModelConfig; the forward pass reads no model_type."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from qworker.model.attention import AttentionBackend, AttentionMetadata
from qworker.model.config import LayerConfig, ModelConfig, NormPlacement
from qworker.model.linear import Linear, PackedWeight, is_packing_available
from qworker.model.mlp import GatedMLP
from qworker.model.moe import SparseMoe
from qworker.model.norm import RMSNorm
from qworker.model.ops import TORCH_OPS, ModelOps
from qworker.model.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: LayerConfig, max_positions: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.scale
        # A window no context can outgrow changes nothing: those layers keep the fast kernels.
        window = layer.sliding_window
        self.sliding_window = window if window is not None and window < max_positions else None
        self.logits_soft_cap = config.attn_logit_soft_cap
        self.rope_table = layer.rope_table
        # q, k and v projections fused into one matmul: [hidden] -> [q_size + 2 * kv_size]
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # Per-head norms over head_dim (Qwen3, Gemma 3), in plain torch: q and k are strided views.
        self.q_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_kind) if config.has_qk_norm else None
        )
        self.k_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_kind) if config.has_qk_norm else None
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        token_seq_lens: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k, token_seq_lens)
        k_cache, v_cache = kv_cache
        out = backend.forward(
            q, k, v, k_cache, v_cache, meta, self.scale,
            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
        )  # fmt: skip
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: LayerConfig, max_positions: int, ops: ModelOps) -> None:
        super().__init__()
        hidden, eps, kind = config.hidden_size, config.rms_norm_eps, config.norm_kind
        self.self_attn = Attention(config, layer, max_positions)
        self.mlp: nn.Module
        if layer.is_moe:
            assert config.moe is not None, "an MoE layer needs the model's MoeConfig"
            self.mlp = SparseMoe(hidden, config.moe, config.activation, ops)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, config.activation, ops)
        self.placement = config.norm_placement
        self.input_layernorm = RMSNorm(hidden, eps, kind, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, kind, ops)
        if self.placement is NormPlacement.SANDWICH:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, kind, ops)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, kind, ops)


class DecoderForCausalLM(nn.Module):
    """A decoder-only model over a paged KV cache, built from a ModelConfig.

    `ops` picks the norm, rotary and activation implementations (see qworker.model.ops).
    """

    def __init__(self, config: ModelConfig, max_positions: int, ops: ModelOps = TORCH_OPS) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, max_positions, ops) for layer in config.layers
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_kind, ops)
        self.rotary = nn.ModuleList(
            RotaryEmbedding(table, config.head_dim, max_positions, ops) for table in config.rope_tables
        )
        self.has_long_rope = any(r.has_long_table for r in self.rotaries)
        # A sequence classifier has a `score` head [num_labels, hidden] and no lm_head.
        self.score = (
            nn.Linear(config.hidden_size, config.num_labels, bias=False) if config.num_labels else None
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings or self.score is not None
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.lm_head_packed = PackedWeight(is_packing_available())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] after the final norm."""
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:
            # As transformers: the scale rounded to the model dtype first.
            hidden = hidden * torch.tensor(self.config.embedding_scale, dtype=hidden.dtype)
        token_seq_lens = None
        if self.has_long_rope:
            # [T]: the whole length of each token's sequence (output_size: no device sync).
            query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
            lens = meta.request_lens if meta.request_lens is not None else meta.seq_lens
            token_seq_lens = torch.repeat_interleave(lens, query_lens, output_size=input_ids.shape[0])
        if self.config.norm_placement is NormPlacement.SANDWICH:
            for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
                rotary = self.rotaries[layer.self_attn.rope_table]
                attn = layer.self_attn(
                    positions, layer.input_layernorm(hidden), rotary, token_seq_lens, kv_cache, meta, backend
                )
                hidden = hidden + layer.post_attention_layernorm(attn)
                mlp = layer.mlp(layer.pre_feedforward_layernorm(hidden))
                hidden = hidden + layer.post_feedforward_layernorm(mlp)
            return self.norm(hidden)
        # Each residual add is fused into the norm that follows it: hidden, residual [T, hidden].
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
            if residual is None:
                residual, hidden = hidden, layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm.add_and_norm(hidden, residual)
            rotary = self.rotaries[layer.self_attn.rope_table]
            hidden = layer.self_attn(positions, hidden, rotary, token_seq_lens, kv_cache, meta, backend)
            hidden, residual = layer.post_attention_layernorm.add_and_norm(hidden, residual)
            hidden = layer.mlp(hidden)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))

    @property
    def rotaries(self) -> list[RotaryEmbedding]:
        return cast(list[RotaryEmbedding], list(self.rotary))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the embedding when tied, else the head's own weight."""
        assert self.score is None, "a sequence classifier has no lm_head"
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_class_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, num_labels], a sequence classifier's `score` head."""
        assert self.score is not None, "not a sequence classifier"
        return self.score(hidden)

    def compute_token_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, len(token_ids)]: the logits of those tokens only (a yes/no
        reranker reads two), soft-capped as compute_logits caps them."""
        logits = hidden @ self.lm_head_weight[token_ids].T
        cap = self.config.final_logit_soft_cap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] in the model dtype, as transformers computes them. Not
        # copied to float32 here: greedy rows take their argmax on these (the same order), and the
        # sampler's random rows and log-softmax convert the rows they use (128 x 49,152 bf16 -> fp32
        # was 1.3 ms of a decode step's lm_head on one core).
        logits = self.lm_head_packed.linear(hidden, self.lm_head_weight)
        cap = self.config.final_logit_soft_cap
        if cap is not None:
            # In the model dtype, as transformers caps them (Gemma 2).
            logits = torch.tanh(logits / cap) * cap
        return logits
