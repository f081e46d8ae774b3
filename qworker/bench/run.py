"""One run's shared parts: its limits, its clock, the state the run loop and a system's hooks
share while it runs (`Run`), and what it returns (`RunResult`).

Below both `system.py` (the hooks take a Run) and `run_loop.py` (which drives them), so that
neither imports the other's types.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qworker.bench.kv_usage import KVSample
from qworker.bench.load import LoadGenerator, SentRequest
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.workload import BenchRequest

Progress = Callable[[int], object]
# A system that waits for news with nothing scheduled wakes up this often to check the limits.
IDLE_POLL_S = 0.5


@dataclass(frozen=True)
class RunLimits:
    """How long a run may take. Whatever is not done by then is counted as a timeout."""

    # Seconds a run may go on after its last scheduled arrival.
    drain_timeout_s: float | None = None
    # Seconds from send to finish for one request.
    request_timeout_s: float | None = None

    def run_deadline(self, requests: Sequence[BenchRequest]) -> float | None:
        if self.drain_timeout_s is None or not requests:
            return None
        return requests[-1].arrival_s + self.drain_timeout_s


@dataclass
class RunResult:
    system: str
    mode: str
    records: list[RequestRecord]
    duration_s: float
    kv_samples: list[KVSample] = field(default_factory=list)
    num_preemptions: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # request id -> generated token ids, when the run was asked to keep them (parity checks).
    token_ids: dict[str, list[int]] | None = None


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
