"""Mixtral: Mistral attention and a sparse MoE block on every layer (top-k weights always
renormalised, kept in float32). Checkpoints name the experts w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

from typing import Any

from qworker.model.config import ModelConfig, MoeConfig
from qworker.model.families.common import activation_of, plain_layers, rope_table, shape_fields


def build_config(hf_config: Any) -> ModelConfig:
    return ModelConfig(
        **shape_fields(hf_config),
        layers=plain_layers(hf_config, is_moe=True),
        rope_tables=(rope_table(hf_config),),
        activation=activation_of(hf_config),
        moe=MoeConfig(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            norm_topk_prob=True,
            is_routing_weight_in_model_dtype=False,
        ),
    )
