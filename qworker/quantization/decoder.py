"""Which layers of a decoder run in int8, and the swap of their float Linear for Int8Linear.

Quantized: every decoder layer's attention projections (the fused qkv_proj, o_proj) and a dense
MLP's (the fused gate_up_proj, down_proj): most of the weights and of the matmul time. Unquantized,
in the model dtype: the token embeddings (a lookup, no matmul), the lm_head (SmolLM2 ties it to the
embeddings, and its logits feed sampling directly; the issue's choice until measured safe), the
norms, rotary tables, a sequence classifier's score head, and MoE experts and routers (their
fused-expert kernels take float weights).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from qworker.model.decoder import DecoderForCausalLM
from qworker.model.mlp import GatedMLP
from qworker.quantization.int8_linear import Int8Linear

logger = logging.getLogger(__name__)


def quantized_projections(model: DecoderForCausalLM) -> list[tuple[nn.Module, str, str]]:
    """(owner module, attribute, decoder name such as layers.0.self_attn.qkv_proj) of every
    projection that W8A8 quantizes."""
    found: list[tuple[nn.Module, str, str]] = []
    for index, layer in enumerate(model.decoder_layers):
        found += [
            (layer.self_attn, "qkv_proj", f"layers.{index}.self_attn.qkv_proj"),
            (layer.self_attn, "o_proj", f"layers.{index}.self_attn.o_proj"),
        ]
        if isinstance(layer.mlp, GatedMLP):
            found += [
                (layer.mlp, "gate_up_proj", f"layers.{index}.mlp.gate_up_proj"),
                (layer.mlp, "down_proj", f"layers.{index}.mlp.down_proj"),
            ]
    return found


def quantize_decoder(
    model: DecoderForCausalLM,
    from_checkpoint: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> int:
    """Replace the projections (see the module docstring) with Int8Linear layers: those named in
    `from_checkpoint` (decoder name -> (int8 weight, scales), a compressed-tensors file's) take
    the file's integers and scales; without it every projection is quantized from its loaded float
    weight. A file that leaves a projection out (its `ignore`) keeps that one in float. Returns
    how many were replaced."""
    count = 0
    for owner, attribute, name in quantized_projections(model):
        linear = getattr(owner, attribute)
        if from_checkpoint is None:
            setattr(owner, attribute, Int8Linear.from_float(linear))
        elif name in from_checkpoint:
            weight_int8, scale = from_checkpoint[name]
            if tuple(weight_int8.shape) != tuple(linear.weight.shape):
                raise ValueError(
                    f"{name}: int8 weight {tuple(weight_int8.shape)}, expected {tuple(linear.weight.shape)}"
                )
            setattr(owner, attribute, Int8Linear(weight_int8, scale, linear.bias))
        else:
            continue
        count += 1
    logger.info("int8 W8A8: %d projection(s) quantized; embeddings and lm_head unquantized", count)
    return count
