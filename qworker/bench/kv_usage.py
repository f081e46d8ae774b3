"""KV cache use over a run, and its waste against a contiguous max-length reservation.

A paged cache wastes only the empty tail slots of each request's last block. A contiguous
allocator (what HF `generate` and pre-vLLM servers do) must reserve, for every running request,
room for its prompt plus all the tokens it may generate, up front. Both are measured at each
engine step and summed over steps, so long busy phases weigh more than short idle ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class KVSample:
    """The cache after one engine step. `t` is seconds since the run started."""

    t: float
    num_used_blocks: int
    num_total_blocks: int
    block_size: int
    num_tokens_stored: int
    num_empty_slots: int
    num_running: int
    num_waiting: int
    # Slots a contiguous allocator would hold for the running requests: prompt + max_tokens each.
    num_contiguous_slots: int
    # The same with every running request reserving the model's whole context.
    num_max_model_len_slots: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(part: float, whole: float) -> float | None:
    return 100.0 * part / whole if whole else None


def summarize_kv(samples: Sequence[KVSample], num_preemptions: int) -> dict[str, Any]:
    """Peak use and waste percentages; waste is empty slots over reserved slots, step-weighted."""
    if not samples:
        return {"num_kv_samples": 0, "num_preemptions": num_preemptions}
    block_size = samples[0].block_size
    used_slots = sum(s.num_used_blocks * block_size for s in samples)
    empty_slots = sum(s.num_empty_slots for s in samples)
    stored = sum(s.num_tokens_stored for s in samples)
    contiguous = sum(s.num_contiguous_slots for s in samples)
    max_len = sum(s.num_max_model_len_slots for s in samples)
    peak = max(s.num_used_blocks for s in samples)
    total = samples[0].num_total_blocks
    return {
        "num_kv_samples": len(samples),
        "num_total_kv_blocks": total,
        "kv_block_size": block_size,
        "peak_kv_blocks_used": peak,
        "peak_kv_usage_pct": _pct(peak, total),
        "peak_num_running": max(s.num_running for s in samples),
        "peak_num_waiting": max(s.num_waiting for s in samples),
        # Paged: empty tail slots as a share of the slots held by blocks in use.
        "kv_waste_pct": _pct(empty_slots, used_slots),
        "max_kv_waste_pct_per_step": max(
            (_pct(s.num_empty_slots, s.num_used_blocks * block_size) or 0.0) for s in samples
        ),
        # Contiguous reservations: reserved-but-unused slots as a share of the reservation.
        "contiguous_waste_pct": _pct(contiguous - stored, contiguous),
        "max_model_len_waste_pct": _pct(max_len - stored, max_len),
        # How many times more slots the contiguous reservation needs than the paged blocks.
        "contiguous_to_paged_slots": contiguous / used_slots if used_slots else None,
        "num_preemptions": num_preemptions,
    }
