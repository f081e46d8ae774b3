"""Building a model whose every weight the checkpoint overwrites, without drawing random ones.

nn.Linear and nn.Embedding draw random weights when they are built (`kaiming_uniform_`,
`normal_`, ...): for SmolLM2 that was 3.9 of the 4.1 s the decoder took to build on one core,
all of it overwritten by the load that follows. Inside `skip_weight_init()` those draws leave
the tensors as `torch.empty` made them. Only for a model that a checkpoint then fills: the
loader's `load_state_dict(strict=True)` refuses a checkpoint that lacks any parameter, so no
undrawn weight survives a load.

The draws are torch.nn.init's functions, which the modules look up at call time: they are
swapped for the duration of the block, process-wide (as transformers' `no_init_weights` does).
A model built in another thread meanwhile would skip its draws too; the engine builds one model
at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


def _leave(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def skip_weight_init(enabled: bool = True) -> Iterator[None]:
    """Within the block, torch.nn.init's random draws do nothing (see the module docstring)."""
    if not enabled:
        yield
        return
    saved = {name: getattr(nn.init, name) for name in RANDOM_INITS}
    try:
        for name in RANDOM_INITS:
            setattr(nn.init, name, _leave)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)
