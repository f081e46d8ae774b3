"""The one run loop every system is measured with: send requests on schedule, let the system make
progress, time out what runs too long, and account for every request.

Timestamps are seconds since the run started on the monotonic perf_counter clock. Failures and
timeouts are never dropped: every request of the run ends with a record and a final status,
including requests never sent before the run's deadline.
"""

from __future__ import annotations

from collections.abc import Sequence

from qworker.bench.records import RequestStatus
from qworker.bench.run import Progress, Run, RunLimits, RunResult
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest

# Warm-up requests: a short fixed prompt of a token id past the control tokens, a few outputs.
WARMUP_PROMPT = (33,) * 64
WARMUP_OUTPUT_LEN = 4


def _ignore_progress(num_finished: int) -> None:
    return None  # no progress display


def run_system(
    system: System,
    requests: Sequence[BenchRequest],
    max_concurrency: int | None = None,
    limits: RunLimits | None = None,
    progress: Progress = _ignore_progress,
    keep_token_ids: bool = False,
) -> RunResult:
    """Serve `requests` (in arrival order) with a prepared system; every record comes back with a
    final status. `progress(n)` is called as requests finish."""
    limits = limits or RunLimits()
    run = Run(requests, max_concurrency, limits, progress, keep_token_ids)
    system.begin(run)
    timeout_s = limits.request_timeout_s
    while True:
        t = run.now()
        for sent in run.load.poll(t):
            system.submit(run, run.open(sent), sent.request)
        if run.deadline is not None and t >= run.deadline:
            break
        if timeout_s is not None:
            for record in [r for r in run.outstanding.values() if t - r.arrival_time > timeout_s]:
                system.cancel(run, record)
                run.finish(record, RequestStatus.TIMEOUT, t, f"exceeded the {timeout_s:g}s request timeout")
        if not run.outstanding and run.load.is_exhausted:
            break
        wake = run.wake_time()
        if system.advance(run, wake):
            continue
        assert wake is not None, f"{system.label}: idle, with nothing outstanding to wait for"
        run.clock.sleep_until(wake)

    # The deadline passed: whatever is left ran out of time.
    t = run.now()
    for record in list(run.outstanding.values()):
        system.cancel(run, record)
        run.finish(record, RequestStatus.TIMEOUT, t, "not finished by the run's time limit")
    run.time_out_unsent(t)
    system.end(run)
    return RunResult(
        system=system.label,
        mode=system.mode,
        records=run.records,
        duration_s=run.now(),
        kv_samples=run.kv_samples,
        num_preemptions=run.num_preemptions,
        meta=dict(run.meta),
        token_ids=run.token_ids,
    )


def warmup_requests(num_requests: int, *, distinct: bool = False) -> list[BenchRequest]:
    """Short warm-up requests; `distinct`: each prompt its own token id (a pool's requests then
    get different affinity keys, and so different lanes)."""
    return [
        BenchRequest(
            f"warmup-{i}",
            i,
            [WARMUP_PROMPT[0] + i] * len(WARMUP_PROMPT) if distinct else list(WARMUP_PROMPT),
            WARMUP_OUTPUT_LEN,
            arrival_s=0.0,
        )
        for i in range(num_requests)
    ]


def warm_up(system: System, num_requests: int = 1, requests: Sequence[BenchRequest] | None = None) -> None:
    """Run a few requests (short ones, or `requests`) unmeasured, through the same loop: compiles,
    caches and thread pools settle, and a broken path fails here rather than in a measurement."""
    requests = warmup_requests(num_requests) if requests is None else requests
    if not requests:
        return
    result = run_system(system, requests)
    bad = next((r for r in result.records if not r.is_completed), None)
    if bad is not None:
        raise RuntimeError(
            f"{system.label}: warm-up request {bad.request_id} ended {bad.status}: {bad.error}"
        )
