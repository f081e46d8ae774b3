"""Building an engine phase by phase, timed (qworker.startup names the phases), and describing the
hardware it runs on. `qworker worker` starts through here, and so does the GPU check's cold-start
stage (qworker/bench/gpu_check/cold_start.py), so both report the same breakdown.

The result is the engine LLMEngine(config) builds. Only the order differs: the weights are
resolved (downloaded, converted) first, the CPU kernels are built or loaded next, and CUDA
graphs are captured last, through ModelRunner.enable_cuda_graphs(), which is what the runner's
constructor would call.
"""

from __future__ import annotations

import dataclasses
import os
import platform

import torch

from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.runner import resolve_device
from qworker.model.loader import resolve_model
from qworker.startup import HardwareInfo, StartupTimings


def load_engine_in_phases(config: EngineConfig, timings: StartupTimings) -> LLMEngine:
    """LLMEngine(config), with its weights, kernels, load and graph capture timed in `timings`."""
    with timings.phase("weights"):
        # The engine resolves the name again below; by then the download or conversion is cached.
        resolve_model(config.model)
    device = resolve_device(config.device)
    with timings.phase("kernels"):
        if device.type == "cpu":
            preload_cpu_kernels()
    capture = device.type == "cuda" and not config.enforce_eager
    with timings.phase("load"):
        # Built eager so that the capture is timed on its own, below.
        engine = LLMEngine(dataclasses.replace(config, enforce_eager=True) if capture else config)
    # The engine reports the caller's config, not the eager one it was built with: graphs replay.
    engine.config = config
    if capture and engine.runner.backend.supports_cuda_graphs:
        with timings.phase("graph_capture"):
            engine.runner.enable_cuda_graphs()
            torch.cuda.synchronize(engine.device)
    return engine


def preload_cpu_kernels() -> dict[str, bool]:
    """Build (first start) or load (cached) the CPU C kernels now rather than inside the model's
    first use; which of them are available."""
    from qworker_kernels import cpu_fused_ops, cpu_paged_attention, cpu_prefill_attention

    return {
        module.__name__.rsplit(".", 1)[-1]: module.is_available()
        for module in (cpu_paged_attention, cpu_prefill_attention, cpu_fused_ops)
    }


def describe_hardware(engine: LLMEngine) -> HardwareInfo:
    device = engine.device
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        name, memory = properties.name, int(properties.total_memory)
    else:
        name, memory = cpu_model_name(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareInfo(
        device=str(device),
        device_name=name,
        device_memory_bytes=memory,
        dtype=str(engine.dtype).removeprefix("torch."),
        num_kv_blocks=engine.num_kv_blocks,
        block_size=engine.config.block_size,
        kv_capacity_tokens=engine.num_kv_blocks * engine.config.block_size,
        batch_invariant=engine.config.batch_invariant,
        is_cuda_graphs_enabled=engine.runner.cuda_graphs is not None,
    )


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
