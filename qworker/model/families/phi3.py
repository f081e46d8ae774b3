"""Phi-3 and Phi-4-mini: Llama-shaped, with q/k/v and gate/up already fused in the checkpoint,
`longrope` scaling (short factors, long ones once a sequence passes the original context) and a
partial rotary factor (Phi-4-mini rotates the first 3/4 of each head)."""

from __future__ import annotations

from typing import Any

from qworker.model.config import ModelConfig
from qworker.model.families.common import activation_of, plain_layers, rope_table, shape_fields


def build_config(hf_config: Any) -> ModelConfig:
    fields = shape_fields(hf_config)
    # Phi3Attention has no biases, whatever attention_bias says.
    fields.update(qkv_bias=False, o_proj_bias=False)
    return ModelConfig(
        **fields,
        layers=plain_layers(hf_config),
        rope_tables=(rope_table(hf_config),),
        activation=activation_of(hf_config),
    )
