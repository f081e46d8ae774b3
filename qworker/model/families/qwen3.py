"""Qwen3: Llama with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import Any

from qworker.model.config import ModelConfig
from qworker.model.families.common import activation_of, plain_layers, rope_table, shape_fields


def build_config(hf_config: Any) -> ModelConfig:
    return ModelConfig(
        **shape_fields(hf_config),
        layers=plain_layers(hf_config),
        rope_tables=(rope_table(hf_config),),
        activation=activation_of(hf_config),
        has_qk_norm=True,
    )
