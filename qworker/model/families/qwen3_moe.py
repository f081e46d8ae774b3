"""Qwen3-MoE: Qwen3 attention, and sparse MoE blocks on the layers that `decoder_sparse_step`
picks and `mlp_only_layers` does not name (dense MLPs of `intermediate_size` elsewhere)."""

from __future__ import annotations

from typing import Any

from qworker.model.config import LayerConfig, ModelConfig, MoeConfig
from qworker.model.families.common import activation_of, layer_windows, rope_table, shape_fields


def is_moe_layer(hf_config: Any, layer_index: int) -> bool:
    # transformers' Qwen3MoeDecoderLayer rule.
    return (
        layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and hf_config.num_experts > 0
        and (layer_index + 1) % hf_config.decoder_sparse_step == 0
    )


def build_config(hf_config: Any) -> ModelConfig:
    layers = tuple(
        LayerConfig(sliding_window=window, rope_table=0, is_moe=is_moe_layer(hf_config, i))
        for i, window in enumerate(layer_windows(hf_config))
    )
    return ModelConfig(
        **shape_fields(hf_config),
        layers=layers,
        rope_tables=(rope_table(hf_config),),
        activation=activation_of(hf_config),
        has_qk_norm=True,
        moe=MoeConfig(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            norm_topk_prob=bool(hf_config.norm_topk_prob),
            is_routing_weight_in_model_dtype=True,
        ),
    )
