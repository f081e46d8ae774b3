"""Hugging Face checkpoint tensors -> the decoder's parameters, checked by name and shape.

The names are transformers' (Llama-style, Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`,
per-expert or stacked `mlp.experts`, Phi-3's fused `qkv_proj` and `gate_up_proj`, Gemma 3's
multimodal `language_model` prefixes). q/k/v and gate/up are fused into one matmul each, and the
experts stacked into [E, 2I, H] and [E, H, I]. A tensor missing, one the model has no place for,
or one of the wrong shape is a CheckpointError naming it: never a silent random weight.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from qworker.errors import CheckpointError
from qworker.model.config import ModelConfig

# Prefixes under which checkpoints keep the language model, most specific first.
LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
# Multimodal parts qworker does not run (Gemma 3's vision tower and projector).
IGNORED_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)
MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
MIXTRAL_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
MAX_NAMES_SHOWN = 5


def _own_name(name: str) -> str | None:
    """A checkpoint name -> the decoder's name for it; None for tensors qworker ignores."""
    if "rotary_emb" in name or name.startswith(IGNORED_PREFIXES):
        return None
    if name.endswith("lm_head.weight") and name.count(".") <= 2:
        return "lm_head.weight"
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    name = MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m[1]}.{MIXTRAL_NAMES[m[2]]}.", name)
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"the checkpoint has no tensor {name!r} (under its model prefix)")
    return tensors.pop(name)


def _fuse(tensors: dict[str, torch.Tensor], fused: str, parts: list[str]) -> None:
    """Concatenate `parts` (dim 0) into `fused`, unless the checkpoint has it fused already."""
    if fused in tensors:
        return
    if not any(part in tensors for part in parts):
        return  # reported as missing by name below
    pieces = [_take(tensors, part) for part in parts]
    if len({tuple(p.shape[1:]) for p in pieces}) != 1:
        shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in zip(parts, pieces, strict=True))
        raise CheckpointError(f"tensors to fuse into {fused!r} disagree in shape: {shapes}")
    tensors[fused] = torch.cat(pieces)


def to_decoder_tensors(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename, fuse and stack a checkpoint's tensors into the decoder's parameter names."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        own = _own_name(name)
        if own is not None:
            tensors[own] = tensor
    if config.tie_word_embeddings:
        # Tied checkpoints sometimes store the head too; the embedding is the one used.
        tensors.pop("lm_head.weight", None)
    for i, layer in enumerate(config.layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        _fuse(tensors, attn + "qkv_proj.weight", [attn + f"{p}_proj.weight" for p in "qkv"])
        if config.qkv_bias:
            _fuse(tensors, attn + "qkv_proj.bias", [attn + f"{p}_proj.bias" for p in "qkv"])
        if not layer.is_moe:
            _fuse(tensors, mlp + "gate_up_proj.weight", [mlp + "gate_proj.weight", mlp + "up_proj.weight"])
            continue
        assert config.moe is not None, "an MoE layer needs the model's MoeConfig"
        experts = mlp + "experts."
        if experts + "gate_up_proj" in tensors:
            continue  # stacked already (transformers 5's own layout)
        num = config.moe.num_experts
        if not any(f"{experts}{e}.gate_proj.weight" in tensors for e in range(num)):
            continue  # reported as missing by name below
        gate_up = []
        for e in range(num):
            p = f"{experts}{e}."
            _fuse(tensors, p + "gate_up_proj.weight", [p + "gate_proj.weight", p + "up_proj.weight"])
            gate_up.append(_take(tensors, p + "gate_up_proj.weight"))
        down = [_take(tensors, f"{experts}{e}.down_proj.weight") for e in range(num)]
        _check_same_shapes(experts + "gate_up_proj", gate_up)
        _check_same_shapes(experts + "down_proj", down)
        tensors[experts + "gate_up_proj"] = torch.stack(gate_up)
        tensors[experts + "down_proj"] = torch.stack(down)
    return tensors


def _check_same_shapes(name: str, pieces: list[torch.Tensor]) -> None:
    shapes = sorted({tuple(p.shape) for p in pieces})
    if len(shapes) != 1:
        raise CheckpointError(f"the experts' tensors for {name!r} differ in shape: {shapes}")


def load_checkpoint(model: nn.Module, state_dict: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Load a Hugging Face state dict into `model` (a DecoderForCausalLM built from `config`)."""
    tensors = to_decoder_tensors(state_dict, config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(
            f"the checkpoint is missing {len(missing)} tensor(s) a {config.model_type} model of this "
            f"config needs: {', '.join(missing[:MAX_NAMES_SHOWN])}"
        )
    if unexpected:
        raise CheckpointError(
            f"the checkpoint has {len(unexpected)} tensor(s) a {config.model_type} model of this "
            f"config has no place for: {', '.join(unexpected[:MAX_NAMES_SHOWN])}"
        )
    wrong = [
        f"{name} is {tuple(tensors[name].shape)}, expected {tuple(param.shape)}"
        for name, param in expected.items()
        if tensors[name].shape != param.shape
    ]
    if wrong:
        raise CheckpointError(
            f"{len(wrong)} checkpoint tensor(s) have the wrong shape for the config: "
            f"{'; '.join(wrong[:MAX_NAMES_SHOWN])}"
        )
    model.load_state_dict(tensors, strict=True)
