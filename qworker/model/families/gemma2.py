"""Gemma 2: GeGLU (tanh GELU), RMSNorm with (1 + weight), norms before and after attention and
MLP, embeddings times sqrt(hidden_size), query_pre_attn_scalar, attention and final-logit
soft-capping, sliding-window and global layers interleaved."""

from __future__ import annotations

from typing import Any

from qworker.model.config import ModelConfig, NormKind, NormPlacement
from qworker.model.families.common import activation_of, plain_layers, rope_table, shape_fields


def gemma_fields(hf_config: Any) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share."""
    return dict(
        norm_kind=NormKind.RMS_PLUS_ONE,
        norm_placement=NormPlacement.SANDWICH,
        activation=activation_of(hf_config, "hidden_activation"),
        attention_scale=hf_config.query_pre_attn_scalar**-0.5,
        attn_logit_soft_cap=getattr(hf_config, "attn_logit_softcapping", None),
        final_logit_soft_cap=getattr(hf_config, "final_logit_softcapping", None),
        embedding_scale=hf_config.hidden_size**0.5,
    )


def build_config(hf_config: Any) -> ModelConfig:
    return ModelConfig(
        **shape_fields(hf_config),
        layers=plain_layers(hf_config),
        rope_tables=(rope_table(hf_config),),
        **gemma_fields(hf_config),
    )
