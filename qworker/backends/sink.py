"""The result-store interface: where the worker writes streamed deltas and final results, and
the notes kept beside them.

The store keeps exactly one result per job id: `write_result` stores only when none exists
and says whether it stored. The read side (`get_result`, `read_deltas`) lives on the same
store, because the client reads what the worker writes there.

Cancel flags, last errors and worker stats are not results: they are `JobNotes`, what clients
and workers tell each other about jobs. Each result store keeps them too (in Redis, under the
same prefix), and a split store (split_sink.py) sends them to its streaming side.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from qworker.jobs.job import JobResult


@dataclass
class Delta:
    """New output of one job since its last delta, or the marker that opens a new attempt."""

    job_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    # Set on the marker a worker writes before a job's second or later attempt streams (the
    # attempt number: the message's delivery count). A marker has no text and no tokens; a
    # reader drops what earlier attempts streamed, because the new attempt streams from the start.
    attempt: int | None = None


def latest_attempt(deltas: list[Delta]) -> list[Delta]:
    """`deltas` from their last attempt marker on (all of them when there is none): what a
    reader that has not yet yielded any of them should see."""
    for i in range(len(deltas) - 1, -1, -1):
        if deltas[i].attempt is not None:
            return deltas[i:]
    return deltas


def wait_for_result(sink: ResultSink, job_id: str, timeout_s: float | None) -> Iterator[Delta]:
    """`read_deltas` for a store that keeps only final results: no deltas, returns once the result
    exists. Raises TimeoutError after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    wait_s = 0.02
    while not sink.has_result(job_id):
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no result for job {job_id} within {timeout_s}s")
        time.sleep(wait_s)
        wait_s = min(0.5, wait_s * 1.5)
    return
    yield  # a generator, like every read_deltas


class JobNotes(abc.ABC):
    """Cancel flags (client -> worker), last errors (one attempt -> the next) and worker stats
    (worker -> operators and the pool-demand exporter)."""

    @abc.abstractmethod
    def request_cancel(self, job_id: str) -> None: ...

    @abc.abstractmethod
    def cancelled_ids(self, job_ids: list[str]) -> set[str]:
        """The ids among `job_ids` whose cancellation was requested."""

    def write_last_errors(self, job_id_to_error: dict[str, str]) -> None:  # noqa: B027 - optional hook
        """Keep, per job id, what went wrong in its latest attempt (or, written as an attempt
        begins, what would explain it never ending: the worker died). The attempt after it reads
        this back when it dead-letters the job, so that the reason names the real error. Kept for
        a day; a store without a place for it forgets."""

    def last_error(self, job_id: str) -> str | None:
        """What write_last_errors kept for the job, or None."""
        return None

    def write_worker_stats(self, worker_name: str, stats: Any) -> None:  # noqa: B027 - optional hook
        """Publish a worker's stats (a dataclass) for operators; a store may ignore them."""


class ResultSink(JobNotes):
    """A result store, with the job notes kept beside its results."""

    @abc.abstractmethod
    def write_deltas(self, deltas: list[Delta]) -> None:
        """Append each delta to its job's live stream (one round trip for a whole engine step)."""

    @abc.abstractmethod
    def write_result(self, result: JobResult) -> bool:
        """Store the final result unless one exists. True if this call stored it."""

    @abc.abstractmethod
    def has_result(self, job_id: str) -> bool: ...

    @abc.abstractmethod
    def get_result(self, job_id: str) -> JobResult | None: ...

    @abc.abstractmethod
    def read_deltas(self, job_id: str, timeout_s: float | None) -> Iterator[Delta]:
        """Yield the job's deltas from the start until its result is written.

        Raises TimeoutError when nothing new arrives within `timeout_s`.
        """

    def end_deltas(self, job_id: str, status: str) -> None:
        """End the job's live stream (its result is stored, here or in another store): a reader
        of `read_deltas` stops. A store that streams deltas must implement it."""

    @abc.abstractmethod
    def delete_result(self, job_id: str) -> None:
        """Remove the job's result, its deltas and its last error (replaying a dead letter,
        dead_letters.clear_failed_result, is the one caller)."""

    def close(self) -> None:
        """Release network resources."""
