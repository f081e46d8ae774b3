"""The result-sink interface: where the worker writes streamed deltas and final results.

The store keeps exactly one result per job id: `write_result` stores only when none exists
and says whether it stored. The read side (`get_result`, `read_deltas`) and the cancel flags
live on the same store, because the client reads what the worker writes there.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from qworker.worker.jobs import JobResult


@dataclass
class Delta:
    """New output of one job since its last delta."""

    job_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)


class ResultSink(abc.ABC):
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

    @abc.abstractmethod
    def request_cancel(self, job_id: str) -> None: ...

    @abc.abstractmethod
    def cancelled_ids(self, job_ids: list[str]) -> set[str]:
        """The ids among `job_ids` whose cancellation was requested."""

    def write_worker_stats(self, worker_name: str, stats: Any) -> None:  # noqa: B027 - optional hook
        """Publish a worker's stats (a dataclass) for operators; a sink may ignore them."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release network resources."""
