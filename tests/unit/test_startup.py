"""A worker's start, phase by phase, and the hardware it reports: the engine built in phases is
the engine LLMEngine builds, the phases are recorded, and the stats JSON and metrics carry them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qworker.startup import STARTUP_PHASES, HardwareInfo, StartupTimings, process_age_s

pytestmark = pytest.mark.timeout(120)


def test_timings_add_up_per_phase_and_refuse_unknown_phases():
    timings = StartupTimings()
    timings.record("import", 1.5)
    with timings.phase("load"):
        pass
    timings.record("load", 2.0)
    assert timings.seconds["import"] == 1.5 and timings.seconds["load"] >= 2.0
    assert timings.summary().startswith("import 1.50s, load 2.0")
    with pytest.raises(AssertionError, match="unknown startup phase"):
        timings.record("warmup", 1.0)
    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600
    timings.mark_ready()
    assert timings.to_ready_s is not None and timings.to_ready_s >= age


def test_an_engine_built_in_phases_matches_llm_engine(tmp_path):
    import torch

    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine
    from qworker.engine.sampling_params import SamplingParams
    from qworker.engine.startup import describe_hardware, load_engine_in_phases
    from qworker.testing.worker_kit import write_tiny_model_dir

    model_dir = write_tiny_model_dir(tmp_path / "tiny")
    config = EngineConfig(
        model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=32, block_size=16
    )
    timings = StartupTimings()
    engine = load_engine_in_phases(config, timings)
    assert set(timings.seconds) == {"weights", "kernels", "load"}, "no graph capture on a CPU"
    assert set(timings.seconds) <= set(STARTUP_PHASES)
    reference = LLMEngine(config)
    prompt = [1, 5, 9, 200]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for eng in (engine, reference):
        eng.add_request("r", {"prompt_token_ids": prompt}, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outputs.append(list(out.output.outputs[0].token_ids))
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6

    hardware = describe_hardware(engine)
    assert hardware.device == "cpu" and hardware.device_name and hardware.device_memory_bytes > 2**30
    assert (hardware.dtype, hardware.num_kv_blocks, hardware.block_size) == ("float32", 32, 16)
    assert hardware.kv_capacity_tokens == 32 * 16
    assert hardware.is_cuda_graphs_enabled is False and engine.config == config
    assert engine.dtype == torch.float32


def test_stats_and_metrics_carry_the_hardware_and_the_startup():
    from qworker.worker.metrics import WorkerMetrics
    from qworker.worker.stats import WorkerStats

    hardware = HardwareInfo(
        "cuda:0", "NVIDIA H200", 150 * 2**30, "bfloat16", 65536, 16, 65536 * 16, is_cuda_graphs_enabled=True
    )
    timings = StartupTimings({"import": 2.0, "weights": 30.0, "load": 4.0, "graph_capture": 6.0}, 43.0)
    stats = WorkerStats(hardware=hardware, startup=timings)
    report = json.loads(json.dumps(dataclasses.asdict(stats)))  # as the Redis sink writes it
    assert report["hardware"]["kv_capacity_tokens"] == 1048576 and report["hardware"]["block_size"] == 16
    assert report["hardware"]["is_cuda_graphs_enabled"] is True
    assert report["startup"]["seconds"]["graph_capture"] == 6.0 and report["startup"]["to_ready_s"] == 43.0

    metrics = WorkerMetrics()
    metrics.set_hardware(hardware)
    metrics.set_startup(timings)
    registry = metrics.registry
    assert registry.get_sample_value("qworker_kv_cache_capacity_tokens") == 1048576
    assert registry.get_sample_value("qworker_kv_cache_block_size_tokens") == 16
    assert registry.get_sample_value("qworker_device_memory_bytes") == 150 * 2**30
    assert registry.get_sample_value("qworker_startup_seconds", {"phase": "graph_capture"}) == 6.0
    assert registry.get_sample_value("qworker_startup_seconds", {"phase": "total"}) == 43.0
    info = {
        "device": "cuda:0", "device_name": "NVIDIA H200", "dtype": "bfloat16", "block_size": "16",
        "cuda_graphs": "true",
    }  # fmt: skip
    assert registry.get_sample_value("qworker_hardware_info", info) == 1.0


def test_a_hardware_capacity_that_does_not_add_up_is_refused():
    with pytest.raises(AssertionError, match="capacity in tokens"):
        HardwareInfo("cpu", "x", 1, "float32", 10, 16, 100)
