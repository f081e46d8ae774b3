"""Gemma 3: Gemma 2's parts without attention soft-capping, plus q/k norms, and one RoPE base for
the sliding-window layers (`rope_local_base_freq`, 10,000) and another for the global ones.

A multimodal checkpoint (`gemma3`, 4B and up) keeps the language model's config in `text_config`:
qworker runs that language model on text and ignores the vision tower and projector."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from qworker.errors import UnsupportedModelError
from qworker.model.config import LayerConfig, ModelConfig
from qworker.model.families.common import layer_windows, rope_table, shape_fields
from qworker.model.families.gemma2 import gemma_fields

LAYER_TYPES = ("sliding_attention", "full_attention")


def build_config(hf_config: Any) -> ModelConfig:
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "gemma3_text with use_bidirectional_attention is an encoder; not supported"
        )
    layer_types = list(hf_config.layer_types)
    layers = tuple(
        LayerConfig(sliding_window=window, rope_table=LAYER_TYPES.index(kind), is_moe=False)
        for window, kind in zip(layer_windows(hf_config), layer_types, strict=True)
    )
    return ModelConfig(
        **shape_fields(hf_config),
        layers=layers,
        rope_tables=tuple(rope_table(hf_config, kind) for kind in LAYER_TYPES),
        has_qk_norm=True,
        **gemma_fields(hf_config),
    )


def build_multimodal_config(hf_config: Any) -> ModelConfig:
    """The language model of a `gemma3` (image-text) checkpoint; the vision tower is not loaded."""
    config = build_config(hf_config.text_config)
    eos_ids = config.eos_token_ids
    eos = getattr(hf_config, "eos_token_id", None)
    if not eos_ids and eos is not None:
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return replace(config, model_type=hf_config.model_type, eos_token_ids=eos_ids)
