"""Values every kernel module shares. Imports torch only: the CPU kernel's module uses it too, on
machines without triton."""

from __future__ import annotations

import os

import torch

# Dtypes of q/k/v, caches and activations that the Triton kernels and the torch decode fallback take.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_triton_interpreter_enabled() -> bool:
    """True under TRITON_INTERPRET=1: Triton kernels run as numpy code on the CPU. Triton reads the
    variable when a kernel is decorated (at its module's import), so it must be set before that."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
