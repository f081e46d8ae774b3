"""Job source and producer in this process's memory (kombu's `memory` transport, with leases).

For unit tests of the worker loop and for trying qworker without a server. Nothing survives the
process. `memory://NAME` opens the queue NAME, shared by every source and producer of the
process; tests usually build a `MemoryQueue` and hand it to `MemorySource` directly.

- lease: messages whose lease expired first (whoever held them), then new ones in order. Each
  lease counts a delivery.
- extend: resets the lease of each message this consumer still holds; a message that a peer
  took after the lease expired is lost.
- ack: removes the message (whoever holds it, like XACK). release: the message is ready again.
- dead_letter: the message moves to `dead_letters` with the reason.
- expire(): ends leases now, as if their holder had stalled past the timeout (for tests).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from qworker.backends.source import JobProducer, JobSource, Lease, OutgoingJob
from qworker.backends.urls import named_location, url_number

# Events in order, as (what, job id or message id): "ack", "release", "dead_letter". A test
# shares one list with a MemoryResultSink (results.py) to check that a result is stored before its ack.
Journal = list[tuple[str, str]]

URL_PARAMS = {"lease_timeout_s"}


@dataclass
class _Message:
    message_id: str
    job_id: str | None
    body: bytes
    enqueued_at: float
    delivery_count: int = 0
    # Who holds the lease and until when (the queue's clock); None while ready.
    consumer: str | None = None
    lease_ends_at: float | None = None


@dataclass
class DeadLetter:
    message_id: str
    job_id: str | None
    body: bytes
    delivery_count: int
    reason: str


class MemoryQueue:
    """One queue: messages in arrival order, leases with their end time, dead letters."""

    def __init__(self, name: str = "memory", clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self.dead_letters: list[DeadLetter] = []
        self._messages: dict[str, _Message] = {}
        self._message_ids = itertools.count(1)
        self._changed = threading.Condition()

    def put(self, body: bytes, job_id: str | None = None, *, enqueued_at: float | None = None) -> str:
        """Enqueue one message; `enqueued_at` (Unix seconds) backdates it. Returns its id."""
        with self._changed:
            message_id = str(next(self._message_ids))
            self._messages[message_id] = _Message(
                message_id, job_id, body, enqueued_at if enqueued_at is not None else time.time()
            )
            self._changed.notify_all()
            return message_id

    def _take_ready(self, consumer: str, max_count: int, lease_timeout_s: float) -> list[Lease]:
        now = self.clock()
        expired = [
            m for m in self._messages.values() if m.lease_ends_at is not None and m.lease_ends_at <= now
        ]
        ready = [m for m in self._messages.values() if m.consumer is None]
        leases = []
        for message in (expired + ready)[:max_count]:
            message.consumer = consumer
            message.lease_ends_at = now + lease_timeout_s
            message.delivery_count += 1
            leases.append(
                Lease(
                    message_id=message.message_id,
                    body=message.body,
                    job_id=message.job_id,
                    delivery_count=message.delivery_count,
                    enqueued_at=message.enqueued_at,
                )
            )
        return leases

    def lease(self, consumer: str, max_count: int, lease_timeout_s: float, block_s: float) -> list[Lease]:
        deadline = time.monotonic() + block_s
        with self._changed:
            while True:
                leases = self._take_ready(consumer, max_count, lease_timeout_s)
                left = deadline - time.monotonic()
                if leases or left <= 0:
                    return leases
                self._changed.wait(left)

    def extend(self, consumer: str, message_ids: list[str], lease_timeout_s: float) -> set[str]:
        """Reset the leases `consumer` still holds; returns the ids it no longer holds."""
        with self._changed:
            lost = set()
            for message_id in message_ids:
                message = self._messages.get(message_id)
                if message is None or message.consumer != consumer:
                    lost.add(message_id)
                else:
                    message.lease_ends_at = self.clock() + lease_timeout_s
            return lost

    def remove(self, message_id: str) -> _Message | None:
        with self._changed:
            return self._messages.pop(message_id, None)

    def release(self, consumer: str, message_ids: list[str]) -> None:
        """Make the messages `consumer` holds ready at once."""
        with self._changed:
            for message_id in message_ids:
                message = self._messages.get(message_id)
                if message is not None and message.consumer == consumer:
                    message.consumer = None
                    message.lease_ends_at = None
            self._changed.notify_all()

    def expire(self, message_ids: list[str] | None = None) -> None:
        """End the leases of these messages (default: all) now, without releasing them: the
        holder still thinks it holds them until it tries to extend."""
        with self._changed:
            now = self.clock()
            for message in self._messages.values():
                is_chosen = message_ids is None or message.message_id in message_ids
                if is_chosen and message.lease_ends_at is not None:
                    message.lease_ends_at = now
            self._changed.notify_all()

    @property
    def num_ready(self) -> int:
        """Messages nobody holds a lease on."""
        with self._changed:
            return sum(m.consumer is None for m in self._messages.values())

    def num_held_by(self, consumer: str) -> int:
        with self._changed:
            return sum(m.consumer == consumer for m in self._messages.values())

    def depth(self) -> int:
        """Messages waiting or held."""
        with self._changed:
            return len(self._messages)


class MemorySource(JobSource):
    def __init__(
        self,
        queue: MemoryQueue,
        *,
        consumer: str,
        lease_timeout_s: float = 30.0,
        max_deliveries: int | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.queue = queue
        self.consumer = consumer
        self.lease_timeout_s = lease_timeout_s
        self.queue_name = f"memory:{queue.name}"
        self.max_deliveries = max_deliveries
        self.journal = journal

    def _record(self, event: str, lease: Lease) -> None:
        if self.journal is not None:
            self.journal.append((event, lease.job_id or lease.message_id))

    def lease(self, max_count: int, block_s: float, *, is_idle: bool = True) -> list[Lease]:
        if max_count <= 0:
            return []
        return self.queue.lease(self.consumer, max_count, self.lease_timeout_s, block_s)

    def extend(self, leases: list[Lease]) -> list[Lease]:
        lost = self.queue.extend(self.consumer, [le.message_id for le in leases], self.lease_timeout_s)
        return [le for le in leases if le.message_id in lost]

    def ack(self, lease: Lease) -> None:
        self.queue.remove(lease.message_id)
        self._record("ack", lease)

    def release(self, leases: list[Lease]) -> None:
        self.queue.release(self.consumer, [le.message_id for le in leases])
        for lease in leases:
            self._record("release", lease)

    def dead_letter(self, lease: Lease, reason: str) -> None:
        self.queue.remove(lease.message_id)
        self.queue.dead_letters.append(
            DeadLetter(lease.message_id, lease.job_id, lease.body, lease.delivery_count, reason)
        )
        self._record("dead_letter", lease)

    def num_pending(self) -> int | None:
        return self.queue.num_held_by(self.consumer)


class MemoryProducer(JobProducer):
    def __init__(self, queue: MemoryQueue) -> None:
        self.queue = queue

    def send(self, jobs: list[OutgoingJob]) -> list[str]:
        return [self.queue.put(job.body, job.job_id) for job in jobs]

    def queue_depth(self) -> int | None:
        return self.queue.depth()


# The named queues of memory:// URLs, shared by the whole process (as kombu's memory transport
# shares its queues); each lives as long as the process.
_named_queues: dict[str, MemoryQueue] = {}
_named_queues_lock = threading.Lock()


def named_queue(name: str) -> MemoryQueue:
    with _named_queues_lock:
        queue = _named_queues.get(name)
        if queue is None:
            queue = _named_queues[name] = MemoryQueue(name)
        return queue


def open_source(url: str, consumer: str, lease_timeout_s: float | None) -> MemorySource:
    name, params = named_location(url, URL_PARAMS, "queue; use memory://NAME")
    return MemorySource(
        named_queue(name),
        consumer=consumer,
        lease_timeout_s=lease_timeout_s or url_number(params, "lease_timeout_s", 30.0),
    )


def open_producer(url: str, payload_location: str | None) -> MemoryProducer:
    name, _ = named_location(url, URL_PARAMS, "queue; use memory://NAME")
    return MemoryProducer(named_queue(name))
