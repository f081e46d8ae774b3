"""What `dtype` resolves to on the CPU, with and without bf16 hardware, and the warning for an
explicit bf16 on a CPU that multiplies it on a slow path."""

from __future__ import annotations

import logging

import pytest
import torch

from qworker.engine import runner
from qworker.engine.llm import LLM
from qworker.testing.worker_kit import write_tiny_model_dir

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")


@pytest.mark.parametrize(("fast_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_is_bf16_only_with_bf16_hardware(monkeypatch, fast_bf16, expected):
    monkeypatch.setattr(runner, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert runner.resolve_dtype("auto", CPU) is expected
    assert runner.resolve_dtype("bf16", CPU) is torch.bfloat16
    assert runner.resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match="use auto, float32, bfloat16 or float16"):
        runner.resolve_dtype("int3", CPU)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_explicit_bf16_without_bf16_hardware_warns(monkeypatch, caplog, tmp_path, fast_bf16):
    monkeypatch.setattr(runner, "cpu_has_fast_bf16", lambda: fast_bf16)
    model_dir = write_tiny_model_dir(tmp_path / "tiny")
    with caplog.at_level(logging.WARNING, logger="qworker.engine.runner"):
        llm = LLM(model=str(model_dir), dtype="bfloat16", device="cpu", num_kv_blocks=16, max_model_len=64)
    assert llm.llm_engine is not None
    warned = [r for r in caplog.records if "slow path" in r.getMessage()]
    assert len(warned) == (0 if fast_bf16 else 1)
