"""What a decoder is made of, as plain data: the shape, and the small named parts in which model
families differ (norm kind and placement, MLP or MoE, attention extras, embedding scale,
soft-capping, per-layer window and RoPE). A family module (qworker.model.families) reads a
Hugging Face config into a `ModelConfig`; the decoder (qworker.model.decoder) builds from it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class NormKind(enum.Enum):
    # transformers' LlamaRMSNorm: normalise in fp32, cast to the model dtype, then times weight.
    RMS = "rms"
    # Gemma's RMSNorm: normalise and multiply by (1 + weight) in fp32, then cast.
    RMS_PLUS_ONE = "rms_plus_one"


class NormPlacement(enum.Enum):
    # norm -> attention -> add; norm -> MLP -> add (Llama, Qwen, Mistral, Phi-3)
    PRE = "pre"
    # norm -> attention -> norm -> add; norm -> MLP -> norm -> add (Gemma 2 and 3)
    SANDWICH = "sandwich"


class Activation(enum.Enum):
    SILU = "silu"
    # tanh-approximated GELU (transformers' gelu_pytorch_tanh): Gemma's GeGLU
    GELU_TANH = "gelu_tanh"


@dataclass(frozen=True)
class RopeTable:
    """One set of rotary frequencies; `long_inv_freq` (longrope) replaces `inv_freq` for a
    sequence whose context passes `original_max_position_embeddings`, as transformers does."""

    # [rotary_dim // 2] float32; rotary_dim < head_dim with a partial rotary factor.
    inv_freq: torch.Tensor
    attention_scaling: float
    long_inv_freq: torch.Tensor | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MoE block: softmax over the router logits, top-k, then (`norm_topk_prob`) the
    chosen weights renormalised to sum to one."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    # Qwen3-MoE casts the routing weights to the model dtype before scaling the experts'
    # outputs; Mixtral keeps them in float32.
    is_routing_weight_in_model_dtype: bool


@dataclass(frozen=True)
class LayerConfig:
    """What differs between the layers of one model."""

    # The query at position i sees key j iff j <= i and i - j < sliding_window.
    sliding_window: int | None
    # Index into ModelConfig.rope_tables.
    rope_table: int
    is_moe: bool


@dataclass(frozen=True)
class ModelConfig:
    """The shape and parts of one decoder-only model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    # Of the dense MLP (layers that are not MoE).
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    eos_token_ids: tuple[int, ...]
    layers: tuple[LayerConfig, ...]
    rope_tables: tuple[RopeTable, ...]
    norm_kind: NormKind = NormKind.RMS
    norm_placement: NormPlacement = NormPlacement.PRE
    activation: Activation = Activation.SILU
    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    has_qk_norm: bool = False
    # Attention scores are q.k * attention_scale (head_dim ** -0.5 unless query_pre_attn_scalar).
    attention_scale: float | None = None
    attn_logit_soft_cap: float | None = None
    final_logit_soft_cap: float | None = None
    # Gemma multiplies the embeddings by sqrt(hidden_size) (rounded to the model dtype).
    embedding_scale: float | None = None
    moe: MoeConfig | None = None
    # A *ForSequenceClassification checkpoint: its `score` head's classes, in place of the
    # lm_head (None: a causal LM).
    num_labels: int | None = None

    def __post_init__(self) -> None:
        assert len(self.layers) == self.num_layers, "one LayerConfig per layer"
        assert self.num_heads % self.num_kv_heads == 0, "query heads are a multiple of KV heads"

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def sliding_window(self) -> int | None:
        """The largest window of any layer, or None when some layer attends to everything."""
        windows = [layer.sliding_window for layer in self.layers]
        if any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    @property
    def has_sliding_window(self) -> bool:
        return any(layer.sliding_window is not None for layer in self.layers)

    @property
    def longrope_original_len(self) -> int | None:
        """With longrope: the context past which a sequence takes the long factors, for all of its
        positions (transformers recomputes the cache when a sequence grows past it)."""
        lens = [t.original_max_position_embeddings for t in self.rope_tables if t.long_inv_freq is not None]
        known = [n for n in lens if n is not None]
        return min(known) if known else None

    @property
    def is_prefix_cacheable(self) -> bool:
        """False with longrope: a block's KV then depends on whether its sequence passed the
        original context (long factors), not on its tokens alone, so blocks cannot be shared."""
        return all(table.long_inv_freq is None for table in self.rope_tables)
