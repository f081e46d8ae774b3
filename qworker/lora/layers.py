"""The adapter layers: each adapted projection of the decoder computes its base output once for
every token of the step, then adds each adapter's delta `(x A) B` for that adapter's tokens only.

The device holds `max_loras` slots. Each adapted module keeps its slots stacked: A transposed as
`[max_loras, in, positions * max_rank]` and B as `[max_loras, positions * max_rank, out]`, where a
fused module (qkv: q, k, v; gate_up: gate, up) gives each projection its own `max_rank` columns
of A and the block of B that writes its output slice. A rank below max_rank is zero-padded.

Per step, the runner builds one `LoRAStepMeta` from the rows' slots with whole-array numpy ops:
the tokens that run an adapter, sorted by slot (stable), and each slot's segment of them. Then:
- CPU: one gather of the adapted tokens' rows, per slot two matmuls on its contiguous segment
  (or, when the segments are short and many, two batched matmuls over segments padded to the
  longest: a constant number of ops whatever the number of adapters), and one index_add back.
- CUDA: the SGMV-style Triton kernels (`qworker_kernels.triton_sgmv`): shrink, then expand,
  one launch each, over the same segments.
A step with no adapted token skips it all; with `enable_lora` off no adapter layer exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from qworker.lora.peft_adapter import LORA_MODULES, LoRAAdapter
from qworker.model.decoder import DecoderForCausalLM
from qworker.model.mlp import GatedMLP

# The batched path pads each slot's segment to the longest: used when that computes at most this
# many times the real rows (small decode segments across many adapters).
MAX_PADDING_FACTOR = 2
# ... and only from this many segments on: below it the per-slot loop has as few ops.
MIN_SEGMENTS_FOR_BATCHED = 3


@dataclass
class LoRAStepMeta:
    """Which tokens of one step run which adapter slot."""

    # [N] int64: the step's token indices that run an adapter, sorted by slot.
    token_indices: torch.Tensor
    # (slot, start, end) per slot with tokens: its segment of token_indices (host ints).
    segments: list[tuple[int, int, int]]
    num_lora_tokens: int
    # Batched CPU path: [S * L] rows of the padded [S slots, L longest] layout to gather from the
    # step's tokens (padding rows repeat a real token), and [N] where each sorted token sits in it.
    padded_gather: torch.Tensor | None = None
    padded_rows: torch.Tensor | None = None
    num_padded_slots: int = 0
    max_segment_len: int = 0
    # CUDA: [S + 1] segment starts and [S] their slots, on the device.
    segment_starts: torch.Tensor | None = None
    segment_slots: torch.Tensor | None = None


def build_step_meta(
    token_slots: np.ndarray, max_loras: int, device: torch.device, *, for_kernels: bool | None = None
) -> LoRAStepMeta | None:
    """token_slots: [T] the adapter slot of each token of the step (-1: the base model). None
    when no token runs an adapter. `for_kernels` (default: on CUDA) adds the segment tensors the
    Triton kernels read; else the CPU path's."""
    lora_tokens = np.flatnonzero(token_slots >= 0)
    num = int(lora_tokens.size)
    if num == 0:
        return None
    slots = token_slots[lora_tokens]
    order = np.argsort(slots, kind="stable")
    token_indices = lora_tokens[order]
    counts = np.bincount(slots, minlength=max_loras)
    active = np.flatnonzero(counts)
    ends = np.cumsum(counts[active])
    starts = ends - counts[active]
    segments = list(zip(active.tolist(), starts.tolist(), ends.tolist(), strict=True))
    max_len = int(counts[active].max())
    meta = LoRAStepMeta(
        token_indices=torch.from_numpy(token_indices).to(device),
        segments=segments,
        num_lora_tokens=num,
        max_segment_len=max_len,
    )
    if for_kernels if for_kernels is not None else device.type == "cuda":
        meta.segment_starts = torch.from_numpy(np.append(starts, num)).to(device)
        meta.segment_slots = torch.from_numpy(active).to(device)
        return meta
    num_slots = int(active[-1]) + 1
    if len(segments) >= MIN_SEGMENTS_FOR_BATCHED and num_slots * max_len <= MAX_PADDING_FACTOR * num:
        sorted_slots = slots[order]
        offsets = np.arange(num) - np.repeat(starts, counts[active])
        rows = sorted_slots * max_len + offsets
        gather = np.full(num_slots * max_len, token_indices[0], dtype=np.int64)
        gather[rows] = token_indices
        meta.padded_gather = torch.from_numpy(gather).to(device)
        meta.padded_rows = torch.from_numpy(rows).to(device)
        meta.num_padded_slots = num_slots
    return meta


class LoRAContext:
    """What every adapter layer reads in a step: the step's metadata (None: base model only)."""

    def __init__(self) -> None:
        self.meta: LoRAStepMeta | None = None


class LoRALinear(nn.Module):
    """A base linear layer plus the deltas of the adapters in the device slots."""

    def __init__(
        self, base: nn.Module, num_positions: int, max_loras: int, max_rank: int, context: LoRAContext
    ) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.max_rank = max_rank
        weight = base.weight
        out_features, in_features = weight.shape
        width = num_positions * max_rank
        # Not buffers: the model's state dict stays the checkpoint's.
        self.lora_a_t = torch.zeros(max_loras, in_features, width, dtype=weight.dtype, device=weight.device)
        self.lora_b_t = torch.zeros(max_loras, width, out_features, dtype=weight.dtype, device=weight.device)
        # Slots whose adapter adapts this module (others add nothing here).
        self.slot_is_set = np.zeros(max_loras, dtype=bool)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        meta = self.context.meta
        if meta is None:
            return out
        if x.is_cuda:
            from qworker_kernels.triton_sgmv import add_lora_sgmv

            assert meta.segment_starts is not None and meta.segment_slots is not None
            add_lora_sgmv(
                out, x, self.lora_a_t, self.lora_b_t, meta.token_indices,
                meta.segment_starts, meta.segment_slots, meta.max_segment_len,
            )  # fmt: skip
            return out
        segments = [seg for seg in meta.segments if self.slot_is_set[seg[0]]]
        if not segments:
            return out
        if meta.padded_gather is not None and len(segments) == len(meta.segments):
            num_slots, length = meta.num_padded_slots, meta.max_segment_len
            xs = x.index_select(0, meta.padded_gather).view(num_slots, length, -1)
            h = torch.bmm(xs, self.lora_a_t[:num_slots])
            ys = torch.bmm(h, self.lora_b_t[:num_slots]).view(num_slots * length, -1)
            assert meta.padded_rows is not None
            out.index_add_(0, meta.token_indices, ys.index_select(0, meta.padded_rows))
            return out
        xs = x.index_select(0, meta.token_indices)
        if len(meta.segments) == 1:
            slot = segments[0][0]
            out.index_add_(
                0, meta.token_indices, torch.mm(torch.mm(xs, self.lora_a_t[slot]), self.lora_b_t[slot])
            )
            return out
        ys = xs.new_zeros(meta.num_lora_tokens, out.shape[1])
        for slot, start, end in segments:
            torch.mm(torch.mm(xs[start:end], self.lora_a_t[slot]), self.lora_b_t[slot], out=ys[start:end])
        out.index_add_(0, meta.token_indices, ys)
        return out

    def set_slot(self, slot: int, adapter: LoRAAdapter | None, layer: int, module: str) -> None:
        """Write the adapter's parts for this module into `slot` (None: clear it)."""
        self.lora_a_t[slot].zero_()
        self.lora_b_t[slot].zero_()
        parts = adapter.parts.get((layer, module), []) if adapter is not None else []
        r_max = self.max_rank
        for part in parts:
            target, rank = part.target, part.rank
            column = target.position * r_max
            self.lora_a_t[slot, :, column : column + rank].copy_(part.lora_a.t())
            self.lora_b_t[
                slot, column : column + rank, target.out_offset : target.out_offset + target.out_size
            ].copy_(part.lora_b.t())
        self.slot_is_set[slot] = bool(parts)


class LoRAModel:
    """Wraps a decoder's adaptable projections in LoRALinear layers, and fills their slots."""

    def __init__(self, model: DecoderForCausalLM, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.context = LoRAContext()
        self.layers: list[tuple[int, str, LoRALinear]] = []
        for index, layer in enumerate(model.decoder_layers):
            owners: list[tuple[nn.Module, str, str]] = [
                (layer.self_attn, "qkv_proj", "self_attn.qkv_proj"),
                (layer.self_attn, "o_proj", "self_attn.o_proj"),
            ]
            if isinstance(layer.mlp, GatedMLP):
                owners += [
                    (layer.mlp, "gate_up_proj", "mlp.gate_up_proj"),
                    (layer.mlp, "down_proj", "mlp.down_proj"),
                ]
            for owner, attribute, module in owners:
                wrapped = LoRALinear(
                    getattr(owner, attribute), LORA_MODULES[module], max_loras, max_rank, self.context
                )
                setattr(owner, attribute, wrapped)
                self.layers.append((index, module, wrapped))
        self.num_bytes = sum(w.lora_a_t.nbytes + w.lora_b_t.nbytes for _, _, w in self.layers)

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for layer, module, wrapped in self.layers:
            wrapped.set_slot(slot, adapter, layer, module)

    def set_step(self, meta: LoRAStepMeta | None) -> None:
        self.context.meta = meta
