from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    # RoPE as transformers computes it for this config (rope scaling included).
    rope_inv_freq: torch.Tensor
    rope_attention_scaling: float
    # A model with an active sliding window is exact only up to the window; the engine caps
    # its context there instead of running a different attention.
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; qworker runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        inv_freq, attention_scaling = _rope_parameters(hf_config, head_dim)
        qkv_bias = model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
        sliding_window = getattr(hf_config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            rope_inv_freq=inv_freq,
            rope_attention_scaling=float(attention_scaling),
            sliding_window=sliding_window,
            eos_token_ids=eos_ids,
        )


def _rope_parameters(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported by this transformers version")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
