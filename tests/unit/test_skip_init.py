"""skip_weight_init: no random draws inside the block, every draw restored after it (an error
inside included), and a checkpoint load still fills every weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qworker.model.skip_init import RANDOM_INITS, skip_weight_init

pytestmark = pytest.mark.timeout(30)


def test_no_draws_inside_and_every_draw_restored_after() -> None:
    before = {name: getattr(nn.init, name) for name in RANDOM_INITS}
    torch.manual_seed(0)
    drawn = nn.Linear(64, 64).weight.detach().clone()
    with pytest.raises(RuntimeError), skip_weight_init():
        torch.manual_seed(0)
        layer = nn.Linear(64, 64)
        state = torch.get_rng_state()
        raise RuntimeError("inside")
    torch.manual_seed(0)
    assert torch.equal(state, torch.get_rng_state()), "nothing was drawn from the generator"
    assert layer.weight.shape == (64, 64)  # its values: whatever memory torch.empty handed out
    assert {name: getattr(nn.init, name) for name in RANDOM_INITS} == before
    torch.manual_seed(0)
    assert torch.equal(nn.Linear(64, 64).weight, drawn)


def test_disabled_draws_as_usual() -> None:
    torch.manual_seed(0)
    drawn = nn.Embedding(16, 8).weight.detach().clone()
    with skip_weight_init(enabled=False):
        torch.manual_seed(0)
        assert torch.equal(nn.Embedding(16, 8).weight, drawn)
