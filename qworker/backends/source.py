"""The job-source interface: what the worker loop needs from a queue.

A source hands out leases. A lease is a message the worker holds until it acks it (done, the
result is stored), releases it (give it back at once for a peer), or dead-letters it (never
retry). While a job runs, the worker extends its lease so that peers do not take it. A lease
that is neither acked nor extended expires, and the queue hands the message out again; that is
how a killed worker loses nothing.

Redis Streams, SQS and Celery (kombu's Redis transport) all map onto this; so does the in-memory
queue of tests (memory/queue.py):
- lease:       XAUTOCLAIM + XREADGROUP | ReceiveMessage              | RPOP into kombu's unacked hash,
                                                                       expired ones restored first
- extend:      XCLAIM JUSTID (idle=0)  | ChangeMessageVisibility     | reset the unacked-index time,
                                                                       only while still ours (Lua)
- ack:         XACK + XDEL             | DeleteMessage               | basic_ack
- release:     idle set past the lease | ChangeMessageVisibility 0   | basic_reject(requeue=True)
- dead_letter: XADD to a dead stream   | SendMessage to the DLQ      | LPUSH envelope + reason to
                                                                       `{queue}.dead`, then ack
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass
class Lease:
    """One message held by this worker."""

    # The queue's own handle for the message (a stream entry id, an SQS receipt handle), unique
    # within the source (a Redis priority-lane entry's id is prefixed with its lane).
    message_id: str
    # The raw body: decoding it (and failing it when it is not a job) is the worker's business.
    body: bytes
    # The job id carried next to the body (a stream field, a message attribute). When the
    # producer gave none, the source derives a stable one from the message's identity.
    job_id: str | None
    # How many times the queue has handed this message out, this time included.
    delivery_count: int
    # When the message entered the queue (Unix seconds), as the queue itself recorded it.
    enqueued_at: float | None
    # The handle to extend, ack or release the message with, when it is not `message_id`: an SQS
    # receipt handle changes with every receive, while `message_id` (the MessageId) stays the
    # same, and job ids are derived from the stable one.
    handle: str | None = None
    # Set when the source refuses the message without decoding it (a Celery message serialized
    # with pickle, an S3 payload pointer that cannot be read): the worker stores a failed result
    # and dead-letters the message with this reason. `body` is then empty.
    rejection: str | None = None
    # When the message stops being worth running (Unix seconds; Celery's `expires`): taken later,
    # the job is cancelled without running.
    expires_at: float | None = None
    # The longest the job may run once taken (seconds; Celery's `time_limit`): its deadline is
    # the earlier of this and the job's own timeout_s.
    time_limit_s: float | None = None


class JobSource(abc.ABC):
    """A queue of jobs, seen by one worker (one consumer)."""

    # How long a lease lasts without extension (seconds). The loop extends well before it ends.
    lease_timeout_s: float
    # Names the queue in derived job ids (see jobs.resolve_job_id).
    queue_name: str
    # Deliveries after which the queue itself moves a message away (an SQS RedrivePolicy's
    # maxReceiveCount), or None. The worker dead-letters with a reason before the queue would
    # do it silently (see Worker.max_attempts).
    max_deliveries: int | None = None

    @abc.abstractmethod
    def lease(self, max_count: int, block_s: float, *, is_idle: bool = True) -> list[Lease]:
        """Take up to `max_count` messages, expired leases of dead peers first.

        Waits up to `block_s` for a message when none is ready (0: do not wait). `is_idle`: the
        caller holds no jobs, so a source may look for expired leases at once when nothing new
        is ready, rather than only on its timer (a busy worker calls this every engine step).
        """

    @abc.abstractmethod
    def extend(self, leases: list[Lease]) -> list[Lease]:
        """Reset the lease timer of each held message. Returns the leases that were lost (a peer
        took the message after our lease expired); the worker must drop those jobs."""

    @abc.abstractmethod
    def ack(self, lease: Lease) -> None:
        """The job's result is stored: remove the message for good."""

    @abc.abstractmethod
    def release(self, leases: list[Lease]) -> None:
        """Give the messages back now, so that a peer can take them without waiting for the lease."""

    @abc.abstractmethod
    def dead_letter(self, lease: Lease, reason: str) -> None:
        """Move the message to the dead-letter queue with the reason, and ack it."""

    def revoked_ids(self, job_ids: list[str]) -> set[str]:
        """The jobs among `job_ids` revoked through the queue itself (Celery's revoke()); the
        worker cancels them as it does on a cancel flag."""
        return set()

    def num_pending(self) -> int | None:
        """Messages this consumer holds, as the queue sees them (for stats); None if unknown."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release network resources."""


@dataclass
class OutgoingJob:
    job_id: str
    body: bytes
    # Ordering group on queues that have them (SQS FIFO MessageGroupId); None: the queue's default.
    group_id: str | None = None
    # The job's priority (lower runs first): a queue with a priority lane puts it there when it
    # is urgent enough (Redis Streams with high_lane_max_priority).
    priority: int = 0
    # The job's affinity key (qworker/jobs/affinity.py): a queue with affinity lanes puts jobs
    # of one key on one lane; None: no key (the queue's shared stream).
    affinity: str | None = None


class JobProducer(abc.ABC):
    """The sending side of a queue, used by the client."""

    @abc.abstractmethod
    def send(self, jobs: list[OutgoingJob]) -> list[str]:
        """Enqueue the jobs (in one round trip where the queue allows). Returns their message ids."""

    def queue_depth(self) -> int | None:
        """Messages waiting or held, for autoscaling and tests; None if the queue cannot tell."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release network resources."""
