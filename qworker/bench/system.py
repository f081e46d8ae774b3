"""What every system under test provides to the run loop (its hooks), and what one run returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from qworker.bench.records import RequestRecord
from qworker.bench.run import Run
from qworker.bench.workload import BenchRequest


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
