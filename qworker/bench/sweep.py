"""Run every system at every rate on the same requests, and collect raw records and summaries.

Systems are loaded and warmed up once, before any measurement. Runs go rate by rate and, within
a rate, system by system, so that a drift in the shared machine's load hits all systems of a
rate alike rather than one system's whole sweep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qworker.bench.kv_usage import summarize_kv
from qworker.bench.metrics import summarize
from qworker.bench.pool_stats import IDEAL_BLOCK_SIZE, ideal_computed_prompt_tokens, pool_summary
from qworker.bench.run import RunLimits
from qworker.bench.run_loop import run_system
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest, WorkloadSpec, request_set_digest


@dataclass(frozen=True)
class RequestSet:
    """The requests of one rate (None: the spec's own arrival process)."""

    rate: float | None
    spec: WorkloadSpec
    requests: list[BenchRequest]

    @property
    def label(self) -> str:
        return rate_label(self.rate, self.spec)

    def describe(self) -> dict[str, Any]:
        prompt_lens = [r.prompt_len for r in self.requests]
        output_lens = [r.output_len for r in self.requests]
        return {
            "rate": effective_rate(self.rate, self.spec),
            "rate_label": self.label,
            "arrival": self.spec.arrival.process,
            "num_requests": len(self.requests),
            "sha256": request_set_digest(self.requests),
            "sha256_without_arrivals": request_set_digest(self.requests, include_arrivals=False),
            "mean_prompt_len": sum(prompt_lens) / len(prompt_lens),
            "max_prompt_len": max(prompt_lens),
            "mean_output_len": sum(output_lens) / len(output_lens),
            "max_output_len": max(output_lens),
            "total_output_tokens": sum(output_lens),
            "last_arrival_s": self.requests[-1].arrival_s,
            "total_prompt_tokens": sum(prompt_lens),
            # One shared, unbounded prefix cache (qworker/bench/pool_stats.py).
            "ideal_prompt_tokens_computed": ideal_computed_prompt_tokens(self.requests),
            "ideal_block_size": IDEAL_BLOCK_SIZE,
        }


def effective_rate(rate: float | None, spec: WorkloadSpec) -> float | None:
    """Requests per second, None for all-at-once/closed-loop arrivals (an infinite rate)."""
    if rate is not None:
        return None if math.isinf(rate) else rate
    return spec.arrival.rate if spec.arrival.process in ("poisson", "gamma") else None


def rate_label(rate: float | None, spec: WorkloadSpec) -> str:
    value = effective_rate(rate, spec)
    if value is not None:
        return f"{value:g}/s"
    if spec.arrival.process == "fixed_concurrency" and rate is None:
        return f"concurrency {spec.arrival.concurrency}"
    return "all at once"


def parse_rates(text: str | None) -> list[float | None]:
    """'0.5,1,2,inf' -> [0.5, 1.0, 2.0, inf]; None -> [None] (the spec's own arrivals)."""
    if not text:
        return [None]
    rates: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--rate: {part!r} is not a number (or inf)") from None
        if not value > 0:
            raise ValueError(f"--rate: {part!r} must be > 0")
        rates.append(value)
    if not rates:
        raise ValueError("--rate: no rates given")
    return rates


def _process_cpu_state() -> dict[str, Any]:
    import os

    import torch

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"torch_threads": torch.get_num_threads(), "num_cpus_usable": affinity}


def run_name(system: str, mode: str) -> str:
    return system if mode == "engine" else f"{system} [{mode}]"


def run_sweep(
    systems: Sequence[System],
    request_sets: Sequence[RequestSet],
    limits: RunLimits,
    slo: dict[str, float] | None,
    percentiles: Sequence[float],
    show_progress: bool = True,
) -> list[dict[str, Any]]:
    """One dict per (rate, system): summary, KV summary, raw records and KV timeline."""
    from tqdm import tqdm

    runs = []
    for request_set in request_sets:
        digest = request_set_digest(request_set.requests)
        ideal = ideal_computed_prompt_tokens(request_set.requests)
        max_concurrency = request_set.spec.arrival.concurrency_limit
        for system in systems:
            name = run_name(system.label, system.mode)
            with tqdm(
                total=len(request_set.requests),
                desc=f"{name} @ {request_set.label}",
                unit="req",
                disable=not show_progress,
                leave=True,
            ) as bar:
                result = run_system(system, request_set.requests, max_concurrency, limits, bar.update)
            assert len(result.records) == len(request_set.requests), (
                f"{name}: {len(result.records)} records for {len(request_set.requests)} requests"
            )
            summary = summarize(result.records, result.duration_s, slo, percentiles)
            kv = summarize_kv(result.kv_samples, result.num_preemptions or 0) if result.kv_samples else None
            runs.append(
                {
                    "name": name,
                    "system": result.system,
                    "mode": result.mode,
                    "rate": effective_rate(request_set.rate, request_set.spec),
                    "rate_label": request_set.label,
                    "request_set_sha256": digest,
                    "summary": summary,
                    "kv": kv,
                    # Queue mode: prompt tokens computed and hit rates, per worker, from the results.
                    "pool": pool_summary(result.records, ideal),
                    # Recorded per run: an in-process system (vLLM) may change the process's
                    # threads or CPU binding for the systems measured after it.
                    "meta": {**result.meta, **_process_cpu_state()},
                    "records": [r.to_dict() for r in sorted(result.records, key=lambda r: r.request_id)],
                    "kv_timeline": [s.to_dict() for s in result.kv_samples],
                }
            )
    return runs
