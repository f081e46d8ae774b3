"""Llama and its close relatives: SmolLM2, Mistral (a window on every layer) and Qwen2 (q/k/v
bias, a window on the layers past `max_window_layers` when `use_sliding_window`)."""

from __future__ import annotations

from typing import Any

from qworker.model.config import ModelConfig
from qworker.model.families.common import activation_of, plain_layers, rope_table, shape_fields


def build_config(hf_config: Any) -> ModelConfig:
    fields = shape_fields(hf_config)
    if hf_config.model_type == "qwen2":
        # Qwen2 has biases on q, k and v but not on o.
        fields.update(qkv_bias=True, o_proj_bias=False)
    return ModelConfig(
        **fields,
        layers=plain_layers(hf_config),
        rope_tables=(rope_table(hf_config),),
        activation=activation_of(hf_config),
    )
