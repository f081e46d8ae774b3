"""A worker's time to ready, phase by phase, and the hardware it serves on: plain data that the
worker logs, publishes in its stats and exposes as metrics (no torch here; the engine-side
measurements are in qworker/engine/startup.py).

Phases, in the order a start goes through them:
  import         process start until torch, transformers and the engine are imported
  queue_connect  opening the queue and the result store
  weights        finding the weights: an s3:// download, a GGUF conversion, or nothing (cached)
  kernels        building or loading the compiled CPU kernels (GPU: Triton compiles during capture)
  load           config, tokenizer, safetensors, the model on its device, the KV cache
  graph_capture  CUDA graphs for the decode batch sizes (GPU only)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

STARTUP_PHASES = ("import", "queue_connect", "weights", "kernels", "load", "graph_capture")


@dataclass
class StartupTimings:
    """Seconds spent in each phase; `to_ready_s` from the process start to ready, when known."""

    seconds: dict[str, float] = field(default_factory=dict)
    to_ready_s: float | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        assert name in STARTUP_PHASES, f"unknown startup phase {name!r}"
        started = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - started)

    def record(self, name: str, seconds: float) -> None:
        assert name in STARTUP_PHASES, f"unknown startup phase {name!r}"
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def mark_ready(self) -> None:
        self.to_ready_s = process_age_s()

    def summary(self) -> str:
        """'import 2.1s, queue_connect 0.0s, ..., 9.4s to ready'."""
        parts = [f"{name} {self.seconds[name]:.2f}s" for name in STARTUP_PHASES if name in self.seconds]
        total = self.to_ready_s if self.to_ready_s is not None else sum(self.seconds.values())
        return ", ".join(parts) + f"; {total:.2f}s to ready"


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: from /proc); None where that is unknown."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the name in field 2 may hold spaces.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class HardwareInfo:
    """What a worker serves on. KV capacity in both units, so that a pool of workers with
    different devices, memory or block sizes can be summed in tokens (see docs/WORKER.md)."""

    device: str  # "cuda:0", "cpu"
    device_name: str  # "NVIDIA H200", the CPU's model name
    device_memory_bytes: int  # the GPU's memory; for a CPU, the machine's
    dtype: str  # "bfloat16"
    num_kv_blocks: int
    block_size: int  # tokens per KV block
    kv_capacity_tokens: int  # num_kv_blocks * block_size: the unit in which mixed pools add up
    # EngineConfig.batch_invariant: a redelivered job repeats its text (docs/reproducibility.md).
    batch_invariant: bool = False
    # Decode steps replay CUDA graphs (CUDA, a backend that supports them, enforce_eager off).
    is_cuda_graphs_enabled: bool = False

    def __post_init__(self) -> None:
        assert self.kv_capacity_tokens == self.num_kv_blocks * self.block_size, "capacity in tokens"
