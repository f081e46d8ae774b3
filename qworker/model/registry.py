"""The model registry: a Hugging Face `model_type` -> the family module that reads its config
(as vLLM's ModelRegistry maps architectures to model classes). Adding a family is one module in
qworker.model.families and one line here; the decoder, runner, scheduler and KV cache are shared."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qworker.errors import UnsupportedModelError
from qworker.model.config import ModelConfig
from qworker.model.families import gemma2, gemma3, llama, mixtral, phi3, qwen3, qwen3_moe

MODEL_FAMILIES: dict[str, Callable[[Any], ModelConfig]] = {
    "llama": llama.build_config,
    "mistral": llama.build_config,
    "qwen2": llama.build_config,
    "qwen3": qwen3.build_config,
    "qwen3_moe": qwen3_moe.build_config,
    "mixtral": mixtral.build_config,
    "gemma2": gemma2.build_config,
    "gemma3_text": gemma3.build_config,
    "gemma3": gemma3.build_multimodal_config,
    "phi3": phi3.build_config,
}

SUPPORTED_MODEL_TYPES = tuple(MODEL_FAMILIES)


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """The ModelConfig of a Hugging Face config; UnsupportedModelError for a model_type no
    family runs, naming the supported ones."""
    model_type = getattr(hf_config, "model_type", None)
    build = MODEL_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if build is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; qworker runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    config = build(hf_config)
    if is_sequence_classifier(hf_config):
        config = dataclasses.replace(config, num_labels=int(hf_config.num_labels))
    return config


def is_sequence_classifier(hf_config: Any) -> bool:
    """A *ForSequenceClassification checkpoint (a `score` head on the last non-pad token, as
    transformers runs it), by its config's architectures."""
    architectures = getattr(hf_config, "architectures", None) or []
    return any(str(name).endswith("ForSequenceClassification") for name in architectures)
