"""What most families read the same way from a Hugging Face config: the shape, the EOS ids, the
per-layer windows and the RoPE frequencies (transformers' own functions for scaled RoPE)."""

from __future__ import annotations

from typing import Any

import torch

from qworker.errors import UnsupportedModelError
from qworker.model.config import Activation, LayerConfig, RopeTable

# transformers' names for the activations qworker runs.
ACTIVATIONS = {
    "silu": Activation.SILU,
    "swish": Activation.SILU,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
    "gelu_tanh": Activation.GELU_TANH,
}


def shape_fields(hf_config: Any) -> dict[str, Any]:
    """The ModelConfig fields every family reads alike."""
    num_heads = hf_config.num_attention_heads
    eos = getattr(hf_config, "eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return dict(
        model_type=hf_config.model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim_of(hf_config),
        rms_norm_eps=hf_config.rms_norm_eps,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        o_proj_bias=bool(getattr(hf_config, "attention_bias", False)),
        eos_token_ids=eos_ids,
    )


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def activation_of(hf_config: Any, attribute: str = "hidden_act") -> Activation:
    name = getattr(hf_config, attribute, "silu")
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"{hf_config.model_type}: activation {name!r} is not supported; qworker runs "
            f"{', '.join(sorted(ACTIVATIONS))}"
        )
    return ACTIVATIONS[name]


def layer_windows(hf_config: Any) -> list[int | None]:
    """Each layer's sliding window as transformers applies it: to the `sliding_attention` layers
    of `layer_types` when the config has them, else to every layer."""
    window = getattr(hf_config, "sliding_window", None)
    num_layers = hf_config.num_hidden_layers
    if window is None:
        return [None] * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return [window] * num_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def plain_layers(hf_config: Any, *, is_moe: bool = False) -> tuple[LayerConfig, ...]:
    return tuple(
        LayerConfig(sliding_window=window, rope_table=0, is_moe=is_moe) for window in layer_windows(hf_config)
    )


def rope_table(hf_config: Any, layer_type: str | None = None) -> RopeTable:
    """RoPE as transformers computes it for this config (or for one layer type of it)."""
    # transformers 5 keeps theta and scaling in `rope_parameters` (per layer type for Gemma 3).
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    head_dim = head_dim_of(hf_config)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    rotary_dim = int(head_dim * partial)
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        positions = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
        return RopeTable(inv_freq=1.0 / (theta ** (positions / rotary_dim)), attention_scaling=1.0)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported by this transformers version")
    init = ROPE_INIT_FUNCTIONS[rope_type]
    extra = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = init(hf_config, torch.device("cpu"), **extra)
    if rope_type != "longrope":
        return RopeTable(inv_freq=inv_freq.float(), attention_scaling=float(scaling))
    original = params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
    long_inv_freq, _ = init(hf_config, torch.device("cpu"), seq_len=original + 1, **extra)
    return RopeTable(
        inv_freq=inv_freq.float(),
        attention_scaling=float(scaling),
        long_inv_freq=long_inv_freq.float(),
        original_max_position_embeddings=int(original),
    )
