"""Values every kernel module shares. Imports torch only: the CPU kernel's module uses it too, on
machines without triton."""

from __future__ import annotations

import math
import os

import torch

# Dtypes of q/k/v, caches and activations that the Triton kernels and the torch decode fallback take.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_triton_interpreter_enabled() -> bool:
    """True under TRITON_INTERPRET=1: Triton kernels run as numpy code on the CPU. Triton reads the
    variable when a kernel is decorated (at its module's import), so it must be set before that."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_attention_extras(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """The per-layer extras every attention kernel takes. `sliding_window` W: the query at position
    i sees key j iff j <= i and i - j < W (None: all keys up to i). `logits_soft_cap` c: the scaled
    scores s become tanh(s / c) * c before the softmax (None: no cap). Raises ValueError otherwise."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool)
        or not isinstance(logits_soft_cap, (int, float))
        or not math.isfinite(logits_soft_cap)
        or logits_soft_cap <= 0
    ):
        raise ValueError(f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap!r}")
