"""The parts of a worker's stats report that the dashboard shows (issue 42), filled in at each
stats write: when it was written and how often it is, who wrote it (host, pid, model, quantization,
loaded adapters and how many loads they took), its running and waiting requests, and its output
tokens per second over the last minute. Additive: readers of the older fields (the exporter's
parse_worker_report) see no change.

A reader tells a live worker from one that stopped reporting by `reported_at` and
`report_interval_s` (two intervals without a write: stopped), long before its key expires.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import Any

from qworker.worker.admission import AdmissionStats
from qworker.worker.engine_protocol import EngineProtocol
from qworker.worker.stats import WorkerStats

# The window of the output rate.
RATE_WINDOW_S = 60.0


def generated_tokens(registry: Any) -> int:
    """The worker's qworker_generation_tokens_total, read through prometheus_client's public API
    (the loop and finish.py count tokens there and nowhere else)."""
    value = registry.get_sample_value("qworker_generation_tokens_total")
    return int(value or 0)


def model_label(model: str) -> str:
    """A model as the dashboard shows it: a name, or a directory's last part."""
    return os.path.basename(model.rstrip("/")) or model


class ReportFiller:
    """Keeps the window of (time, tokens generated) samples behind the output rate."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.started_at = time.time()
        self._samples: deque[tuple[float, int]] = deque()

    def fill(
        self, stats: WorkerStats, admission: AdmissionStats, engine: EngineProtocol, registry: Any
    ) -> None:
        now = time.time()
        tokens = generated_tokens(registry)
        self._samples.append((now, tokens))
        while len(self._samples) > 2 and self._samples[1][0] <= now - RATE_WINDOW_S:
            self._samples.popleft()
        first_t, first_tokens = self._samples[0]
        config = engine.config
        stats.reported_at = now
        stats.report_interval_s = self.interval_s
        stats.host = self.host
        stats.pid = self.pid
        stats.started_at = self.started_at
        stats.model = model_label(str(config.model))
        # The engine's own: a compressed-tensors W8A8 checkpoint runs int8 without the option.
        stats.quantization = getattr(engine, "quantization", None) or getattr(config, "quantization", None)
        stats.adapters = engine.loaded_adapter_names()
        stats.num_adapter_loads, stats.num_adapter_slot_loads = engine.adapter_loads()
        stats.num_waiting = admission.num_jobs_not_started
        stats.num_running = admission.num_jobs_held - admission.num_jobs_not_started
        stats.num_generated_tokens = tokens
        stats.output_tokens_per_s = (tokens - first_tokens) / (now - first_t) if now > first_t else 0.0
