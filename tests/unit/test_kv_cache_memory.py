"""The KV pool's size from EngineConfig, vLLM's way: num_kv_blocks > kv_cache_memory_bytes >
gpu_memory_utilization (a fraction of the GPU's total memory, weights and activations included);
the deprecated kv_cache_memory_gb; and the start-up reporting the config it serves with. CUDA's
memory figures are stubbed (torch.cuda.mem_get_info), so this runs on the CPU."""

from __future__ import annotations

import dataclasses
import logging
import typing
from types import SimpleNamespace

import pytest
import torch

from qworker.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from qworker.engine import kv_cache_memory
from qworker.engine.kv_cache_memory import (
    KVCacheMemoryError,
    activation_bytes_estimate,
    kv_cache_budget_bytes,
)
from qworker.model.config import ModelConfig

pytestmark = pytest.mark.timeout(60)

GIB = 2**30
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture
def model_config() -> ModelConfig:
    # SmolLM2-135M's shapes: the sizing reads only these.
    shapes = SimpleNamespace(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
    )
    return typing.cast(ModelConfig, shapes)


def stub_cuda(monkeypatch, *, free: int, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_gpu_memory_utilization_must_be_in_zero_one(value: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)
    EngineConfig(gpu_memory_utilization=1.0)


def test_kv_cache_memory_gb_is_a_deprecated_alias_of_bytes(caplog) -> None:
    with pytest.warns(DeprecationWarning, match="kv_cache_memory_gb is deprecated"):
        config = EngineConfig(kv_cache_memory_gb=1.5)
    assert (config.kv_cache_memory_bytes, config.kv_cache_memory_gb) == (int(1.5 * GIB), None)
    assert "kv_cache_memory_gb is deprecated" in caplog.text
    # One field holds the size from here on: replace() does not see both.
    assert dataclasses.replace(config, enforce_eager=True).kv_cache_memory_bytes == int(1.5 * GIB)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_cache_memory_gb=1.0, kv_cache_memory_bytes=GIB)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be >= 1"):
        EngineConfig(kv_cache_memory_bytes=0)


def test_cuda_budget_is_the_fraction_of_total_less_what_is_used(monkeypatch, model_config) -> None:
    # An 80 GiB GPU with 2 GiB in use once the weights are loaded (weights, context, allocator).
    stub_cuda(monkeypatch, free=78 * GIB, total=80 * GIB)
    config = EngineConfig(gpu_memory_utilization=0.5)
    activations = activation_bytes_estimate(config, model_config, torch.bfloat16)
    assert 0 < activations < GIB
    budget = kv_cache_budget_bytes(config, model_config, CUDA, torch.bfloat16)
    assert budget == 40 * GIB - 2 * GIB - activations
    # The default is vLLM's 0.9 of the total, not 85% of the free memory as before.
    default = kv_cache_budget_bytes(EngineConfig(), model_config, CUDA, torch.bfloat16)
    assert default == int(0.9 * 80 * GIB) - 2 * GIB - activations


def test_a_fraction_that_leaves_no_room_is_an_error(monkeypatch, model_config) -> None:
    stub_cuda(monkeypatch, free=60 * GIB, total=80 * GIB)  # 20 GiB in use: another process
    with pytest.raises(KVCacheMemoryError, match=r"gpu_memory_utilization=0.2 of 80.0 GiB leaves no room"):
        kv_cache_budget_bytes(EngineConfig(gpu_memory_utilization=0.2), model_config, CUDA, torch.bfloat16)


def test_kv_cache_memory_bytes_wins_over_the_fraction(monkeypatch, model_config, caplog) -> None:
    stub_cuda(monkeypatch, free=78 * GIB, total=80 * GIB)
    config = EngineConfig(kv_cache_memory_bytes=3 * GIB, gpu_memory_utilization=0.5)
    with caplog.at_level(logging.WARNING, logger=kv_cache_memory.__name__):
        assert kv_cache_budget_bytes(config, model_config, CUDA, torch.bfloat16) == 3 * GIB
    assert "not used" in caplog.text


def test_the_fraction_is_not_used_on_the_cpu(model_config, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=kv_cache_memory.__name__):
        budget = kv_cache_budget_bytes(
            EngineConfig(gpu_memory_utilization=0.5), model_config, CPU, torch.float32
        )
    assert budget == DEFAULT_CPU_KV_CACHE_BYTES == 2 * GIB
    assert "not used on cpu" in caplog.text
    assert (
        kv_cache_budget_bytes(EngineConfig(kv_cache_memory_bytes=GIB), model_config, CPU, torch.float32)
        == GIB
    )


def test_the_started_engine_reports_the_config_it_serves_with(monkeypatch, tmp_path) -> None:
    """On CUDA the start-up builds eager and captures graphs after; the engine's config must not
    keep the eager flag it was built with. A CPU engine stands in for the CUDA one (the device is
    stubbed in startup only; the torch backend captures nothing)."""
    from qworker.engine import startup
    from qworker.startup import StartupTimings
    from qworker.testing.worker_kit import write_tiny_model_dir

    model_dir = write_tiny_model_dir(tmp_path / "tiny")
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=16)
    monkeypatch.setattr(startup, "resolve_device", lambda name: CUDA)
    engine = startup.load_engine_in_phases(config, StartupTimings())
    assert engine.config.enforce_eager is False and engine.config == config
    assert startup.describe_hardware(engine).is_cuda_graphs_enabled is False  # torch: no graphs
    monkeypatch.setattr(type(engine.runner), "cuda_graphs", property(lambda runner: object()))
    assert startup.describe_hardware(engine).is_cuda_graphs_enabled is True
