"""Read a LoRA adapter in PEFT's format and check it against the base model.

PEFT's `save_pretrained` writes `adapter_config.json` (peft_type LORA, r, lora_alpha, use_rslora,
rank_pattern, alpha_pattern, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module path>.lora_A.weight` ([r, in]) and `.lora_B.weight` ([out, r]). Each
adapted projection adds `scale * B(A(x))` to the base output, with `scale = alpha / r`, or
`alpha / sqrt(r)` with rsLoRA. The scale is folded into B here, once.

qworker fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj`: an adapter's
per-projection A/B lands on its projection's slice of the fused output (`Target`). Phi-3's
checkpoints (and so its adapters) name the fused projections themselves; they cover the whole
fused output.

Everything that makes an adapter unusable is a LoRAAdapterError naming the adapter and the
problem, raised before any tensor reaches a device slot (the checks: docs/lora.md).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qworker.errors import LoRAAdapterError
from qworker.lora.request import LoRARequest
from qworker.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# One adapted projection's tensors:
# base_model.model.[model.][language_model.]layers.N.<block>.<proj>.lora_A|B.weight
LORA_TENSOR = re.compile(
    r"^base_model\.model\.(?:[\w.]*\.)?layers\.(\d+)\.(self_attn|mlp)\.([\w.]+)\.lora_([AB])\.weight$"
)
# adapter_config.json settings that change the forward pass in ways qworker does not run: each
# must be absent, false or empty.
UNSUPPORTED_SETTINGS = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters (LoRA on parameters, such as MoE experts)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}
MAX_NAMES_SHOWN = 3


@dataclass(frozen=True)
class Target:
    """Where one projection's delta lands in qworker's decoder: the fused module, the slice
    position within its stacked A/B (q, k, v = 0, 1, 2; gate, up = 0, 1), and the output slice."""

    module: str  # "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"
    position: int
    out_offset: int
    out_size: int
    in_size: int


# The decoder modules that take adapters, and how many slice positions each has.
LORA_MODULES = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}


def lora_targets(config: ModelConfig, *, is_moe_layer: bool) -> dict[str, Target]:
    """The projection names (PEFT's, under `self_attn.` or `mlp.`) an adapter may adapt in one
    layer, and where each lands."""
    hidden, q, kv = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    qkv = "self_attn.qkv_proj"
    targets = {
        "self_attn.q_proj": Target(qkv, 0, 0, q, hidden),
        "self_attn.k_proj": Target(qkv, 1, q, kv, hidden),
        "self_attn.v_proj": Target(qkv, 2, q + kv, kv, hidden),
        "self_attn.qkv_proj": Target(qkv, 0, 0, q + 2 * kv, hidden),
        "self_attn.o_proj": Target("self_attn.o_proj", 0, 0, hidden, q),
    }
    if not is_moe_layer:
        inter = config.intermediate_size
        gate_up = "mlp.gate_up_proj"
        targets.update(
            {
                "mlp.gate_proj": Target(gate_up, 0, 0, inter, hidden),
                "mlp.up_proj": Target(gate_up, 1, inter, inter, hidden),
                "mlp.gate_up_proj": Target(gate_up, 0, 0, 2 * inter, hidden),
                "mlp.down_proj": Target("mlp.down_proj", 0, 0, hidden, inter),
            }
        )
    return targets


@dataclass(frozen=True)
class LoRAPart:
    """One adapted projection of one layer: A [rank, in] and B [out_size, rank] with the scale
    folded in, landing at `target`."""

    target: Target
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapter:
    """A checked adapter in host memory: its parts by (layer index, decoder module)."""

    request: LoRARequest
    rank: int
    parts: dict[tuple[int, str], list[LoRAPart]]

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def num_bytes(self) -> int:
        return sum(p.lora_a.nbytes + p.lora_b.nbytes for ps in self.parts.values() for p in ps)


def _problem(request: LoRARequest, message: str) -> LoRAAdapterError:
    return LoRAAdapterError(
        f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}, {request.lora_path}): {message}"
    )


def _pattern_value(pattern: dict[str, Any], module_name: str) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: the first key that matches the module's name or
    a dotted suffix of it (peft.utils.other.get_pattern_key)."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", module_name):
            return pattern[key]
    return None


def read_adapter_config(request: LoRARequest) -> dict[str, Any]:
    path = Path(request.lora_path).expanduser() / CONFIG_FILE
    if not path.is_file():
        raise _problem(request, f"no {CONFIG_FILE} in the adapter directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _problem(request, f"{CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _problem(request, f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(request: LoRARequest, config: dict[str, Any], max_rank: int) -> tuple[int, float, bool]:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _problem(request, f"peft_type is {peft_type!r}; only LORA adapters are served")
    for key, what in UNSUPPORTED_SETTINGS.items():
        if config.get(key):
            raise _problem(request, f"{what} is not supported (adapter_config.json sets {key})")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _problem(request, f"bias {bias!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _problem(request, f"r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise _problem(request, f"lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise _problem(request, f"{key} must be an object")
    ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise _problem(request, f"rank {max(ranks)} is over max_lora_rank {max_rank}")
    return rank, float(alpha), bool(config.get("use_rslora", False))


def _read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    directory = Path(request.lora_path).expanduser()
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise _problem(request, f"only {WEIGHTS_FILE} is read (adapter_model.bin is a pickle)")
        raise _problem(request, f"no {WEIGHTS_FILE} in the adapter directory")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError, ValueError) as exc:
        raise _problem(request, f"{WEIGHTS_FILE} is not readable: {exc}") from None


def load_adapter(request: LoRARequest, model_config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter of `request` for a model of `model_config` (in this thread:
    the manager calls it from its loader thread)."""
    directory = Path(request.lora_path).expanduser()
    if not directory.is_dir():
        raise _problem(request, "the adapter directory does not exist")
    config = read_adapter_config(request)
    rank, alpha, use_rslora = _check_config(request, config, max_rank)
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    tensors = _read_tensors(request)
    if not tensors:
        raise _problem(request, f"{WEIGHTS_FILE} holds no tensors")

    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    not_lora = []
    for name, tensor in tensors.items():
        match = LORA_TENSOR.match(name)
        if match is None:
            not_lora.append(name)
            continue
        layer, block, proj, which = int(match[1]), match[2], match[3], match[4]
        pairs.setdefault((layer, block, proj), {})[which] = tensor
    if not_lora:
        shown = ", ".join(sorted(not_lora)[:MAX_NAMES_SHOWN])
        raise _problem(
            request, f"{len(not_lora)} tensor(s) are not LoRA A/B weights of a decoder layer: {shown}"
        )

    parts: dict[tuple[int, str], list[LoRAPart]] = {}
    num_layers = len(model_config.layers)
    for (layer, block, proj), pair in sorted(pairs.items()):
        module_name = f"model.layers.{layer}.{block}.{proj}"
        if layer >= num_layers:
            raise _problem(request, f"{module_name}: the model has {num_layers} layers")
        is_moe = model_config.layers[layer].is_moe
        if block == "mlp" and is_moe:
            raise _problem(request, f"{module_name}: LoRA on MoE experts and routers is not supported")
        target = lora_targets(model_config, is_moe_layer=is_moe).get(f"{block}.{proj}")
        if target is None:
            raise _problem(
                request, f"{module_name}: the {model_config.model_type} model has no such projection to adapt"
            )
        if set(pair) != {"A", "B"}:
            raise _problem(request, f"{module_name}: lora_{'B' if 'A' in pair else 'A'} is missing")
        lora_a, lora_b = pair["A"], pair["B"]
        r_module = _pattern_value(rank_pattern, module_name) or rank
        if lora_a.dim() != 2 or lora_b.dim() != 2:
            raise _problem(request, f"{module_name}: lora_A and lora_B must be matrices")
        expected_a, expected_b = (r_module, target.in_size), (target.out_size, r_module)
        if tuple(lora_a.shape) != expected_a or tuple(lora_b.shape) != expected_b:
            raise _problem(
                request,
                f"{module_name}: lora_A is {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)}, "
                f"the base model needs {expected_a} and {expected_b} (rank {r_module})",
            )
        if r_module > max_rank:
            raise _problem(request, f"{module_name}: rank {r_module} is over max_lora_rank {max_rank}")
        if not lora_a.is_floating_point() or not lora_b.is_floating_point():
            raise _problem(request, f"{module_name}: the weights are {lora_a.dtype}, not floating point")
        if not (torch.isfinite(lora_a).all() and torch.isfinite(lora_b).all()):
            raise _problem(request, f"{module_name}: the weights hold NaN or inf")
        alpha_module = _pattern_value(alpha_pattern, module_name) or alpha
        scale = alpha_module / math.sqrt(r_module) if use_rslora else alpha_module / r_module
        part = LoRAPart(target, lora_a.float().contiguous(), (lora_b.float() * scale).contiguous())
        existing = parts.setdefault((layer, target.module), [])
        for other in existing:
            o = other.target
            if (
                o.out_offset < target.out_offset + target.out_size
                and target.out_offset < o.out_offset + o.out_size
            ):
                raise _problem(
                    request, f"{module_name}: overlaps another adapted projection of its fused module"
                )
        existing.append(part)
    return LoRAAdapter(request, max(p.rank for ps in parts.values() for p in ps), parts)
