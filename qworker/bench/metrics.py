"""Serving metrics from request traces, with vLLM `bench serve` key names.

Definitions (as in vLLM's benchmarks/serve.py):
- TTFT: first chunk time - send time.
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with at least two tokens.
- ITL: the gaps between successive chunks, pooled over all requests.
- E2EL: finish time - send time.
- Throughputs: completed requests' counts over the run's duration.
- Goodput: completed requests that meet every given SLO, per second. A request with one token
  has TPOT 0 for the SLO check, as in vLLM.
Latency statistics cover completed requests only. Failures and timeouts are never dropped:
`failed` counts every request that did not complete (vLLM's meaning) and `timed_out` is the
part of it that ran out of time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from qworker.bench.records import DEFAULT_PERCENTILES, RequestRecord, RequestStatus

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


class SLOError(ValueError):
    """An --slo string that cannot be parsed."""


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' -> {'ttft_ms': 500.0, 'tpot_ms': 50.0}."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise SLOError(f"bad SLO {part!r}: use key=milliseconds with keys {SLO_KEYS}")
        try:
            limit = float(value)
        except ValueError:
            raise SLOError(f"bad SLO {part!r}: {value!r} is not a number") from None
        if not limit > 0:
            raise SLOError(f"bad SLO {part!r}: the limit must be > 0")
        slo[key] = limit
    return slo


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def latency_stats(
    name: str, values_s: Sequence[float], percentiles: Sequence[float]
) -> dict[str, float | None]:
    """mean/median/std/pXX of `values_s` (seconds) as `{stat}_{name}_ms` keys; None when empty."""
    keys = ["mean", "median", "std", *(percentile_key(p) for p in percentiles)]
    if not len(values_s):
        return {f"{k}_{name}_ms": None for k in keys}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats: dict[str, float | None] = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        # Linear interpolation between closest ranks: numpy's default, the one vLLM uses.
        stats[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.is_completed:
        return False
    ttft, e2el = record.ttft, record.e2el
    tpot = record.tpot if record.tpot is not None else 0.0
    checks = {"ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2el}
    for key, limit_ms in slo.items():
        value = checks[key]
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The `bench serve` summary of one run. Every record must have a final status."""
    for r in records:
        assert r.status is not None, f"request {r.request_id} has no final status"
    assert duration_s > 0, f"duration must be > 0, got {duration_s}"
    done = [r for r in records if r.is_completed]
    num_timeout = sum(r.status is RequestStatus.TIMEOUT for r in records)
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.num_output_tokens for r in done)
    summary: dict[str, Any] = {
        "num_prompts": len(records),
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "timed_out": num_timeout,
        "errored": len(records) - len(done) - num_timeout,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_output_tokens_requested": sum(r.output_len for r in done),
        # Completed with fewer tokens than asked for (e.g. stopped because the cache was full).
        "num_truncated": sum(r.num_output_tokens < r.output_len for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        summary["slo"] = dict(slo)
        summary["good_completed"] = good
        summary["request_goodput"] = good / duration_s
    per_metric: dict[str, list[float]] = {
        "ttft": [v for r in done if (v := r.ttft) is not None],
        "tpot": [v for r in done if (v := r.tpot) is not None],
        "itl": [v for r in done for v in r.itls],
        "e2el": [v for r in done if (v := r.e2el) is not None],
    }
    for name in LATENCY_METRICS:
        summary.update(latency_stats(name, per_metric[name], percentiles))
    waits = [r.queue_wait_s for r in done if r.queue_wait_s is not None]
    if waits:
        summary.update(latency_stats("queue_wait", waits, percentiles))
    return summary
