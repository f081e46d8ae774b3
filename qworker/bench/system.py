"""What every system under test provides, and what one run of it returns."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from qworker.bench.kv_usage import KVSample
from qworker.bench.load import LoadGenerator
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.workload import BenchRequest

Progress = Callable[[int], object]


class Finish(Protocol):
    """Gives a record its final status at time t (with an error message for anything but success)."""

    def __call__(
        self, record: RequestRecord, status: RequestStatus, t: float, error: str | None = None
    ) -> None: ...


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


class System(Protocol):
    label: str
    mode: str

    def prepare(self) -> None:
        """Load the model and warm up. Not part of any measurement."""

    def describe(self) -> dict[str, Any]:
        """The system's configuration, for the report."""

    def run(
        self,
        requests: Sequence[BenchRequest],
        max_concurrency: int | None,
        limits: RunLimits,
        progress: Progress,
    ) -> RunResult:
        """Serve the requests as they arrive; every record comes back with a final status."""

    def close(self) -> None: ...


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


def new_record(request: BenchRequest, send_time: float) -> RequestRecord:
    return RequestRecord(
        request_id=request.request_id,
        prompt_len=request.prompt_len,
        output_len=request.output_len,
        arrival_time=send_time,
    )


def time_out_unsent(load: LoadGenerator, t: float, progress: Progress) -> list[RequestRecord]:
    """Records for requests never sent before the run's deadline: timeouts, never dropped."""
    records = []
    for request in load.drain():
        record = new_record(request, request.arrival_s)
        record.finish(RequestStatus.TIMEOUT, t, "not sent before the run's time limit")
        records.append(record)
        progress(1)
    return records
