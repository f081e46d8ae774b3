"""Dead-letter queues, for operators: list, show, replay and purge what a worker dead-lettered.

Each queue backend with a dead-letter queue has a `DeadLetterQueue` in its package (its
`open_dead_letters`, chosen by the queue URL's scheme through the backend table, __init__.py):

- Redis Streams: the stream `{stream}:dead` (entry id = the dead letter's id).
- SQS: the dead-letter queue (the `dead_letter` URL parameter, else the queue's RedrivePolicy
  target, else `{queue}-dlq`); the id is the dead letter's MessageId. SQS cannot peek, so reading
  receives every message and makes it visible again at once.
- Celery: the list `{queue}.dead` of JSON records (reason, task id, the broker's envelope); the
  id is the task id.

Replay puts the original body back on the job queue as a new message (its delivery count starts
again at 1), removes the dead letter, and removes the job's stored *failed* result and its
streamed deltas: results are written first-wins, so a failed result left in place would make the
worker ack the replayed copy without running it. A completed result is never removed (its job
is skipped again, as any duplicate is).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from qworker.backends.sink import ResultSink
from qworker.jobs.job import JobStatus, resolve_job_id

# Dead letters read at most, per command: the tooling is for inspection, not bulk export.
DEFAULT_LIST_LIMIT = 1000
# How long an SQS dead letter stays invisible while it is being read (it is made visible again
# right after; this only bounds the time if the reader dies in between).
SQS_READ_VISIBILITY_S = 30


@dataclass
class DeadLetter:
    """One dead-lettered message."""

    # The dead letter's own id within its queue (what show and replay take).
    id: str
    job_id: str | None
    reason: str
    # Deliveries of the job when it was dead-lettered.
    attempts: int
    # When the message was dead-lettered (Unix seconds), when the queue records it.
    dead_at: float | None
    # The original message body (the job JSON; an S3 pointer for a large SQS job).
    body: bytes
    # The queue the message came from, where the backend records it (a Redis stream or its
    # priority lane): replay puts it back there.
    source: str | None = None

    def age_s(self, now: float | None = None) -> float | None:
        return None if self.dead_at is None else (now or time.time()) - self.dead_at

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "job_id": self.job_id,
            "reason": self.reason,
            "attempts": self.attempts,
            "dead_at": self.dead_at,
            "age_s": self.age_s(),
            "body": self.body.decode("utf-8", "backslashreplace"),
            "source": self.source,
        }


class DeadLetterQueue(abc.ABC):
    """The dead letters of one job queue."""

    @abc.abstractmethod
    def read(self, limit: int = DEFAULT_LIST_LIMIT) -> list[DeadLetter]:
        """Dead letters, oldest first."""

    def show(self, dead_letter_id: str) -> DeadLetter | None:
        return next((d for d in self.read() if d.id == dead_letter_id), None)

    @abc.abstractmethod
    def replay(self, dead_letter_ids: Iterable[str] | None, results: ResultSink | None) -> list[DeadLetter]:
        """Put these dead letters (None: all) back on the job queue as new messages and remove
        them here; before each goes back, its failed result in `results` is removed (else the
        worker would skip it). Returns those replayed; an id not found is skipped."""

    @abc.abstractmethod
    def purge(self) -> int:
        """Remove every dead letter; returns how many there were."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release network resources."""


def clear_failed_result(sink: ResultSink, job_id: str) -> bool:
    """Remove the job's stored result, its deltas and last error when the result is a failure (or
    there is none), so that a replayed job runs. Returns whether a failed result was removed."""
    result = sink.get_result(job_id)
    if result is not None and result.status is not JobStatus.FAILED:
        return False
    sink.delete_result(job_id)
    return result is not None


def with_replay_id(letter: DeadLetter) -> DeadLetter:
    """The letter with the job id its replay runs under. A body that is a job without an id would
    get one derived from its new message, which nobody could know in advance: the replay names
    it instead (stable per dead letter), so `qworker dlq replay` can print it. A body that is no
    job at all keeps no id: the worker will dead-letter it again, with its reason."""
    if letter.job_id is not None:
        return letter
    job_id = resolve_job_id(None, letter.body, "replay", letter.id)
    return letter if job_id is None else dataclasses.replace(letter, job_id=job_id)


def clear_before_replay(results: ResultSink | None, letter: DeadLetter) -> None:
    if results is not None and letter.job_id is not None:
        clear_failed_result(results, letter.job_id)
