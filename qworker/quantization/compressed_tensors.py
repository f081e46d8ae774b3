"""The reader of a compressed-tensors W8A8 checkpoint (format int-quantized; the layout that
llmcompressor writes and vLLM reads): each quantized Linear `X` stores `X.weight` as int8 [out, in]
and `X.weight_scale` as [out, 1] (per channel) or [1] (per tensor), in the checkpoint's float
dtype; symmetric, so no zero point. Activation scales are dynamic: nothing stored.

The tensors are split here into the float checkpoint the decoder loads as usual (the int8 weights
replaced by their dequantized values, so that the loader's name and shape checks cover them) and
the int8 weights with their scales, renamed and fused (q, k, v -> qkv_proj; gate, up -> gate_up_proj:
per-channel scales concatenate along the output dim) as the loader fuses float weights.
"""

from __future__ import annotations

import torch

from qworker.errors import CheckpointError
from qworker.model.config import ModelConfig
from qworker.model.weights import to_decoder_tensors

SCALE_SUFFIX = ".weight_scale"
ZERO_POINT_SUFFIX = ".weight_zero_point"


def split_w8a8_checkpoint(
    state_dict: dict[str, torch.Tensor], config: ModelConfig
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """state_dict (the file's names) -> (a float state dict with the file's names, {decoder name:
    (int8 weight, fp32 scales [out])}) for qworker.quantization.decoder.quantize_decoder."""
    floats = dict(state_dict)
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name in [n for n in state_dict if n.endswith(SCALE_SUFFIX)]:
        weight_name = name[: -len(SCALE_SUFFIX)] + ".weight"
        weight = floats.get(weight_name)
        if weight is None or weight.dtype != torch.int8:
            found = "absent" if weight is None else str(weight.dtype)
            raise CheckpointError(f"{name} scales {weight_name}, which is {found}, not int8")
        scale = floats.pop(name).to(torch.float32).reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(weight.shape[0]).contiguous()
        if scale.numel() != weight.shape[0]:
            raise CheckpointError(f"{name} has {scale.numel()} scales for {weight.shape[0]} output channels")
        zero_point = floats.pop(weight_name[: -len(".weight")] + ZERO_POINT_SUFFIX, None)
        if zero_point is not None and bool(zero_point.any()):
            raise CheckpointError(
                f"{weight_name} has a non-zero zero point: asymmetric int8 is not supported"
            )
        weights[weight_name] = weight
        scales[weight_name] = scale
        floats[weight_name] = weight.to(torch.float32) * scale[:, None]
    stray = sorted(n for n, t in floats.items() if t.dtype == torch.int8)
    if stray:
        raise CheckpointError(f"int8 tensor(s) without a weight_scale: {', '.join(stray[:5])}")
    if not weights:
        raise CheckpointError("a compressed-tensors W8A8 checkpoint without any int8 weight and weight_scale")
    fused_weights = to_decoder_tensors(weights, config)
    # The scales go through the same renaming and fusing, stored under their weights' names.
    fused_scales = to_decoder_tensors(scales, config)
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, weight in fused_weights.items():
        if not name.endswith(".weight") or name not in fused_scales:
            raise CheckpointError(f"int8 tensor {name!r} cannot be placed in the decoder")
        quantized[name[: -len(".weight")]] = (weight, fused_scales[name])
    return floats, quantized
