"""The one run loop every system is measured with: send requests on schedule, let the system make
progress, time out what runs too long, and account for every request.

Timestamps are seconds since the run started on the monotonic perf_counter clock. Failures and
timeouts are never dropped: every request of the run ends with a record and a final status,
including requests never sent before the run's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from qworker.bench.kv_usage import KVSample
from qworker.bench.load import LoadGenerator, SentRequest
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.system import RunLimits, RunResult, System
from qworker.bench.workload import BenchRequest

Progress = Callable[[int], object]
# Warm-up requests: a short fixed prompt of a token id past the control tokens, a few outputs.
WARMUP_PROMPT = (33,) * 64
WARMUP_OUTPUT_LEN = 4
# A system that waits for news with nothing scheduled wakes up this often to check the limits.
IDLE_POLL_S = 0.5


class RunClock:
    """Seconds since the run started, on the monotonic perf_counter clock."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


def _ignore_progress(num_finished: int) -> None:
    return None  # no progress display


class Run:
    """One run's state, shared by the loop and the system's hooks."""

    def __init__(
        self,
        requests: Sequence[BenchRequest],
        max_concurrency: int | None,
        limits: RunLimits,
        progress: Progress,
        keep_token_ids: bool,
    ) -> None:
        self.clock = RunClock()
        self.load = LoadGenerator(requests, max_concurrency)
        self.limits = limits
        self.deadline = limits.run_deadline(requests)
        self.progress = progress
        self.records: list[RequestRecord] = []
        # Sent and not finished, in send order.
        self.outstanding: dict[str, RequestRecord] = {}
        self.kv_samples: list[KVSample] = []
        self.num_preemptions: int | None = None
        self.meta: dict[str, object] = {}
        self.token_ids: dict[str, list[int]] | None = {} if keep_token_ids else None

    def now(self) -> float:
        return self.clock.now()

    def open(self, sent: SentRequest) -> RequestRecord:
        request = sent.request
        record = RequestRecord(
            request_id=request.request_id,
            prompt_len=request.prompt_len,
            output_len=request.output_len,
            arrival_time=sent.send_time,
        )
        assert record.request_id not in self.outstanding, f"request {record.request_id} sent twice"
        self.records.append(record)
        self.outstanding[record.request_id] = record
        if self.token_ids is not None:
            self.token_ids[record.request_id] = []
        return record

    def emit(
        self, record: RequestRecord, t: float, num_tokens: int = 1, token_ids: Sequence[int] = ()
    ) -> None:
        """A chunk of output appeared at time t (a chunk may carry no count: queue-mode text)."""
        assert record.status is None, f"output for finished request {record.request_id}"
        record.add_chunk(t, num_tokens)
        if self.token_ids is not None:
            self.token_ids[record.request_id].extend(token_ids)

    def finish(
        self, record: RequestRecord, status: RequestStatus, t: float, error: str | None = None
    ) -> None:
        """Give a sent request its final status; its concurrency slot frees at t."""
        assert self.outstanding.pop(record.request_id, None) is record, (
            f"request {record.request_id} is not outstanding"
        )
        timeout_s = self.limits.request_timeout_s
        is_late = timeout_s is not None and t - record.arrival_time > timeout_s
        if status is RequestStatus.COMPLETED and is_late:
            status, error = RequestStatus.TIMEOUT, f"finished past the {timeout_s:g}s request timeout"
        record.finish(status, t, error)
        self.load.on_finished(t)
        self.progress(1)

    def wake_time(self) -> float | None:
        """The next time the loop must act by itself: a send or the deadline."""
        wake = self.load.next_send_time()
        if self.deadline is not None:
            wake = self.deadline if wake is None else min(wake, self.deadline)
        return wake

    def time_out_unsent(self, t: float) -> None:
        """Requests never sent before the run's deadline: timeouts, never dropped."""
        for request in self.load.drain():
            record = RequestRecord(
                request.request_id, request.prompt_len, request.output_len, request.arrival_s
            )
            record.finish(RequestStatus.TIMEOUT, t, "not sent before the run's time limit")
            self.records.append(record)
            self.progress(1)


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


def warmup_requests(num_requests: int) -> list[BenchRequest]:
    return [
        BenchRequest(f"warmup-{i}", i, list(WARMUP_PROMPT), WARMUP_OUTPUT_LEN, arrival_s=0.0)
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
