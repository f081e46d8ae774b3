"""Which quantization an engine start runs, from `EngineConfig.quantization` and the checkpoint's
`quantization_config` (config.json), decided once, before any weight is read.

    option     checkpoint                          runs
    none       none                                the checkpoint's bf16/fp32 weights (the default)
    int8       none                                W8A8, weights quantized at load (no calibration)
    none|int8  compressed-tensors W8A8 int8        W8A8 from the file's int8 weights and scales
    any        any other quant_method or scheme    refused: one line naming what is supported

A W8A8 file runs quantized without the option, as vLLM infers the method from the checkpoint:
its weights are int8 already. What is supported is what Int8Linear computes: symmetric int8
weights with one scale per output channel (or one per tensor), and activations quantized per
token at run time (symmetric, dynamic), as compressed-tensors' W8A8 preset writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from qworker.config import QUANTIZATION_METHODS
from qworker.errors import CheckpointError

COMPRESSED_TENSORS = "compressed-tensors"
# compressed-tensors' name for int8 weights stored as int8 tensors beside their scales.
INT_QUANTIZED_FORMAT = "int-quantized"
SUPPORTED_CHECKPOINTS = (
    "compressed-tensors W8A8 int8 (format int-quantized: symmetric int8 weights per channel or "
    "tensor, dynamic symmetric int8 activations per token)"
)


class QuantizationSource(str, Enum):
    # the checkpoint's float weights, quantized as they load
    AT_LOAD = "at-load"
    # int8 weights and scales read from a compressed-tensors file
    COMPRESSED_TENSORS = COMPRESSED_TENSORS


@dataclass(frozen=True)
class QuantizationPlan:
    method: str  # "int8": W8A8
    source: QuantizationSource
    # The layers a compressed-tensors file keeps unquantized (its `ignore`), as written there.
    ignore: tuple[str, ...] = ()


def resolve_quantization(requested: Any, checkpoint_config: Any) -> QuantizationPlan | None:
    """The plan for `requested` (EngineConfig.quantization, checked there) and the checkpoint's
    quantization_config (a dict, or None for a float checkpoint); CheckpointError, one line, for a
    quantized checkpoint qworker cannot run."""
    # QuantizationMethod is a str Enum: its value is the plain name.
    method = getattr(requested, "value", requested)
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be none or {', '.join(QUANTIZATION_METHODS)}, got {requested!r}")
    if checkpoint_config is None:
        return QuantizationPlan(method, QuantizationSource.AT_LOAD) if method else None
    config = _as_dict(checkpoint_config)
    method = config.get("quant_method")
    if method != COMPRESSED_TENSORS:
        raise CheckpointError(
            f"a checkpoint quantized with quant_method {method!r} is not supported; qworker runs "
            f"{SUPPORTED_CHECKPOINTS}, or a bf16/fp32 checkpoint quantized at load with quantization=int8"
        )
    problem = w8a8_problem(config)
    if problem is not None:
        raise CheckpointError(
            f"this compressed-tensors checkpoint is not W8A8 int8 ({problem}); qworker runs "
            f"{SUPPORTED_CHECKPOINTS}, or a bf16/fp32 checkpoint quantized at load with quantization=int8"
        )
    ignore = tuple(str(name) for name in config.get("ignore") or ())
    return QuantizationPlan("int8", QuantizationSource.COMPRESSED_TENSORS, ignore)


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)  # a transformers QuantizationConfigMixin
    if callable(to_dict):
        return dict(to_dict())
    raise CheckpointError(f"the checkpoint's quantization_config is not a mapping: {config!r}")


def w8a8_problem(config: Mapping[str, Any]) -> str | None:
    """What makes a compressed-tensors quantization_config other than W8A8 int8; None if it is."""
    status = config.get("quantization_status")
    if status not in (None, "compressed"):
        return f"quantization_status {status!r}, not compressed"
    if config.get("kv_cache_scheme"):
        return "a quantized KV cache (kv_cache_scheme)"
    if config.get("transform_config"):
        return "transforms (transform_config)"
    if config.get("sparsity_config"):
        return "sparsity (sparsity_config)"
    groups = config.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        return "no config_groups"
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            return f"config group {name!r} is not a mapping"
        group_format = group.get("format") or config.get("format")
        if group_format != INT_QUANTIZED_FORMAT:
            return f"group {name!r} has format {group_format!r}"
        weights, inputs = group.get("weights"), group.get("input_activations")
        if group.get("output_activations"):
            return f"group {name!r} quantizes output activations"
        problem = _args_problem(weights, ("channel", "tensor"), dynamic=False)
        if problem is not None:
            return f"group {name!r} weights: {problem}"
        problem = _args_problem(inputs, ("token",), dynamic=True)
        if problem is not None:
            return f"group {name!r} input activations: {problem}"
    return None


def _args_problem(args: Any, strategies: tuple[str, ...], *, dynamic: bool) -> str | None:
    if not isinstance(args, Mapping):
        return "not quantized" if args is None else f"not a mapping: {args!r}"
    wanted = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": dynamic}
    for key, value in wanted.items():
        if args.get(key) != value:
            return f"{key} {args.get(key)!r}, not {value!r}"
    if args.get("strategy") not in strategies:
        return f"strategy {args.get('strategy')!r}, not {' or '.join(strategies)}"
    if args.get("group_size") is not None or args.get("block_structure") is not None:
        return "group or block scales"
    return None
