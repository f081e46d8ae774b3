"""What every system under test provides to the run loop (its hooks), and what one run returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qworker.bench.kv_usage import KVSample
from qworker.bench.records import RequestRecord
from qworker.bench.workload import BenchRequest

if TYPE_CHECKING:
    from qworker.bench.run_loop import Run


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


class System(ABC):
    """A system under test, as the hooks that `run_loop.run_system` calls.

    The loop owns the clock, the load (send times, concurrency cap), the records, request
    timeouts, the run's deadline, warm-up and progress. A system only takes the requests it is
    sent and makes progress on them, reporting tokens and finishes through `Run.emit` and
    `Run.finish`.
    """

    label: str
    mode: str = "engine"

    @abstractmethod
    def prepare(self) -> None:
        """Load the model (or start the worker). Not measured; `run_loop.warm_up` follows."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The system's configuration, for the report."""

    def close(self) -> None:
        """Free what prepare() took."""
        return None

    def begin(self, run: Run) -> None:
        """A run starts: reset per-run state."""
        return None

    @abstractmethod
    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        """`request` was sent at `record.arrival_time`: queue it or start it. A request the
        system refuses is finished at once (`run.finish(record, FAILED, ...)`)."""

    @abstractmethod
    def advance(self, run: Run, wake: float | None) -> bool:
        """Make progress on what was submitted: one engine step, one static batch, or (for a
        system whose work happens elsewhere) wait for news until `wake` (run seconds; None: no
        send or deadline is due). False when there is nothing to do: the loop then sleeps until
        `wake` itself."""

    @abstractmethod
    def cancel(self, run: Run, record: RequestRecord) -> None:
        """Stop work on an unfinished request; the loop counts it as a timeout."""

    def end(self, run: Run) -> None:
        """The run is over: add per-run figures to `run.meta` (or `run.num_preemptions`)."""
        return None
