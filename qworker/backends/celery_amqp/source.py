"""Job source on a Celery queue over RabbitMQ: Celery protocol v2 messages taken with basic.get.

A service enqueues with its own Celery app, `send_task("qworker.generate", kwargs=job,
queue="qworker")`, on a queue declared with the `task_queues` of docs/WORKER.md; qworker takes the
messages itself (not through Celery's worker pool), so admission by free KV blocks and continuous
batching apply, and writes results to Celery's Redis result backend (`--results celery+redis://`).

Prefetch follows admission through basic.get, not basic.consume: the loop asks for exactly the
number of jobs admission allows, and each basic.get takes one message, so the worker never holds
a message it cannot start soon (a consumer's basic.qos prefetch window would be filled by the
broker ahead of admission, and shrinking it does not take back what was already pushed). The
cost is one round trip per message (about 0.2 ms on loopback), small against a job's
generation; while idle the source polls every POLL_S.

- lease: basic.get with manual ack; the message stays unacked on this channel until ack.
- extend: AMQP has no lease to renew. A delivery is ours for as long as our channel lives; when
  it closes (connection lost, broker restart, RabbitMQ's consumer_timeout, 30 minutes by default,
  closing a channel whose delivery stays unacked past it), the broker requeues every delivery it
  held. extend makes one round trip (a passive declare) to notice a closed channel, and returns
  the leases of older channels as lost; the worker drops those jobs, and the requeued copies
  run again (here or on a peer; a stored result makes the copy an ack).
- ack: basic.ack after the result is stored. An ack on a channel that is gone is skipped: the
  message was requeued, and its redelivery finds the result and is acked.
- release: basic.reject(requeue=True). A killed worker's socket is closed by its kernel and the
  broker requeues its deliveries at once: there is no lease timeout to wait out, as there is on
  Redis Streams (reclaim idle) and SQS (visibility timeout).
- dead_letter: the message, unread, is published (with publisher confirms) to the dead-letter
  exchange `{queue}.dead` with the reason in its headers (x-qworker-reason, ...), then acked. A
  quorum queue's own x-delivery-limit dead-letters there too, with RabbitMQ's x-death header.
- delivery count: quorum queues count for us (the x-delivery-count header). Classic queues have no
  delivery limit: qworker counts deliveries per task id in a Redis hash `{queue}.deliveries`
  (delivery_store=redis://...); without a store the count is 1, or 2 once RabbitMQ marks the
  message redelivered, so max_attempts above 2 cannot bound a poison message there.
- priority: classic queues with x-max-priority: RabbitMQ orders by the message's priority
  property (Celery's `priority=`; higher first). Quorum queues in RabbitMQ 3.x have none.

Celery's controls, as on the Redis transport (../celery/source.py): `expires`, `eta`/`countdown`
(held here unacked until due; a countdown longer than consumer_timeout would cost the channel),
`timelimit`, and `revoke()`, heard on Celery's `celery.pidbox` fanout exchange through a
private auto-delete queue. The body is deserialized only when it is application/json in utf-8,
uncompressed; pickle and everything else is dead-lettered unread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from qworker.backends.celery.holding import EtaHold, RevokedIds
from qworker.backends.celery.source import (
    ACCEPTED_CONTENT_TYPE,
    DELIVERY_COUNT_TTL_S,
    CelerySource,
    _header_time,
    _time_limits,
    envelope_rejection,
)
from qworker.backends.celery_amqp.broker import AmqpBroker
from qworker.backends.celery_amqp.url import AmqpQueue, parse_amqp_url
from qworker.backends.source import JobSource, Lease
from qworker.backends.urls import url_number

logger = logging.getLogger(__name__)

POLL_S = 0.02
# Headers qworker adds to a dead letter (the message itself is copied unread).
REASON_HEADER = "x-qworker-reason"
DELIVERY_COUNT_HEADER = "x-qworker-delivery-count"
DEAD_AT_HEADER = "x-qworker-dead-at"


def deliveries_key(queue: str) -> str:
    return f"{queue}.deliveries"


class AmqpCelerySource(JobSource):
    def __init__(
        self, config: AmqpQueue, *, consumer: str, lease_timeout_s: float = 30.0, delivery_store: Any = None
    ) -> None:
        self.config = config
        self.consumer = consumer
        self.lease_timeout_s = lease_timeout_s
        self.queue_name = f"celery:{config.queue}"
        # Past x-delivery-limit returns the broker dead-letters the message itself.
        self.max_deliveries = None if config.delivery_limit is None else config.delivery_limit + 1
        self.broker = AmqpBroker(config, listen_for_revokes=True)
        self.delivery_store = delivery_store
        # message id -> the message, while held (dead_letter copies it).
        self._messages: dict[str, Any] = {}
        self._eta_hold = EtaHold()
        self._revoked = RevokedIds()
        self.broker.call("connecting", lambda channel: None)

    # -- lease -------------------------------------------------------------------------------

    def lease(self, max_count: int, block_s: float, *, is_idle: bool = True) -> list[Lease]:
        if max_count <= 0:
            return []
        deadline = time.monotonic() + block_s
        # Held-back messages of a channel that closed were requeued by the broker: forget them.
        self._eta_hold.keep_only(self._is_current)
        leases = self._eta_hold.take_due(max_count)
        queue = self.config.queue
        while len(leases) < max_count:
            message = self.broker.call("basic.get", lambda ch: ch.basic_get(queue, no_ack=False))
            if message is not None:
                lease = self._lease_of(message)
                if not self._eta_hold.hold(lease):
                    leases.append(lease)
                continue
            if leases or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        return leases

    def _lease_of(self, message: Any) -> Lease:
        properties = message.properties
        headers = dict(properties.get("application_headers") or {})
        content_type = properties.get("content_type")
        encoding = (properties.get("content_encoding") or "utf-8").lower()
        rejection = envelope_rejection(content_type, encoding, headers)
        tag = message.delivery_info["delivery_tag"]
        message_id = f"{self.broker.generation}:{tag}"
        self._messages[message_id] = message
        task_id = headers.get("id")
        task_id = task_id if isinstance(task_id, str) and task_id else None
        body = b""
        if rejection is None:
            body, rejection = CelerySource.job_body(bytes(message.body))
        eta = _header_time(headers.get("eta"))
        if eta is not None and rejection is None:
            self._eta_hold.note_eta(message_id, eta)
        hard, soft = _time_limits(headers.get("timelimit"))
        return Lease(
            message_id=message_id,
            body=body,
            job_id=task_id,
            delivery_count=self._count_delivery(task_id, headers, message.delivery_info),
            enqueued_at=None,
            handle=message_id,
            rejection=rejection,
            expires_at=_header_time(headers.get("expires")),
            time_limit_s=hard if hard is not None else soft,
        )

    def _count_delivery(self, task_id: str | None, headers: dict[str, Any], info: dict[str, Any]) -> int:
        if self.config.queue_type == "quorum":
            # The broker's count of earlier deliveries (absent on the first).
            return int(headers.get("x-delivery-count") or 0) + 1
        if self.delivery_store is not None and task_id is not None:
            key = deliveries_key(self.config.queue)
            pipe = self.delivery_store.pipeline(transaction=False)
            pipe.hincrby(key, task_id, 1)
            pipe.expire(key, DELIVERY_COUNT_TTL_S)
            return int(pipe.execute()[0])
        return 2 if info.get("redelivered") else 1

    def _is_current(self, lease: Lease) -> bool:
        return self.broker.is_open and lease.message_id.split(":", 1)[0] == str(self.broker.generation)

    def _tag(self, lease: Lease) -> int:
        return int(lease.message_id.split(":", 1)[1])

    # -- holding and letting go --------------------------------------------------------------

    def extend(self, leases: list[Lease]) -> list[Lease]:
        if leases and self.broker.is_open:
            # One round trip: a channel the broker closed (consumer_timeout) shows here; once
            # it is gone, every lease it held is lost.
            with contextlib.suppress(ConnectionError):
                self.broker.call(
                    "checking the channel", lambda ch: ch.queue_declare(self.config.queue, passive=True)
                )
        lost = [le for le in leases if not self._is_current(le)]
        for lease in lost:
            self._messages.pop(lease.message_id, None)
        return lost

    def ack(self, lease: Lease) -> None:
        self._messages.pop(lease.message_id, None)
        if not self._is_current(lease):
            logger.info(
                "message %s: its channel closed before the ack; the redelivery is acked", lease.message_id
            )
            return
        self.broker.call("basic.ack", lambda ch: ch.basic_ack(self._tag(lease)))
        if self.delivery_store is not None and lease.job_id is not None:
            self.delivery_store.hdel(deliveries_key(self.config.queue), lease.job_id)

    def release(self, leases: list[Lease]) -> None:
        for lease in leases:
            self._messages.pop(lease.message_id, None)
            if self._is_current(lease):
                self.broker.call(
                    "basic.reject",
                    lambda ch, le=lease: ch.basic_reject(self._tag(le), requeue=True),  # type: ignore[misc]
                )

    def dead_letter(self, lease: Lease, reason: str) -> None:
        import amqp  # type: ignore[import-untyped]

        message = self._messages.get(lease.message_id)
        if message is None or not self._is_current(lease):
            return  # requeued with its channel: the next delivery is dead-lettered again
        properties = dict(message.properties)
        headers = dict(properties.get("application_headers") or {})
        headers.update(
            {
                REASON_HEADER: reason[:4000],
                DELIVERY_COUNT_HEADER: lease.delivery_count,
                DEAD_AT_HEADER: time.time(),
            }
        )
        properties["application_headers"] = headers
        copy = amqp.Message(bytes(message.body), **properties)
        dead = self.config.dead_letter
        self.broker.call(
            "dead-lettering", lambda ch: ch.basic_publish_confirm(copy, exchange=dead, routing_key=dead)
        )
        self.ack(lease)

    def num_pending(self) -> int | None:
        return len(self._messages)

    def revoked_ids(self, job_ids: list[str]) -> set[str]:
        self._hear_revokes()
        return {job_id for job_id in job_ids if job_id in self._revoked}

    def _hear_revokes(self) -> None:
        queue = self.broker.revoke_queue
        while self.broker.is_open and queue is not None:
            message = self.broker.call("reading revokes", lambda ch: ch.basic_get(queue, no_ack=True))
            if message is None:
                break
            self._revoked.add(revoked_task_ids(message))

    def close(self) -> None:
        try:
            if self.broker.is_open:
                self.release(self._eta_hold.leases())
        finally:
            self._eta_hold.clear()
            self.broker.close()
            if self.delivery_store is not None:
                self.delivery_store.close()


def revoked_task_ids(message: Any) -> list[str]:
    """The task ids of a Celery control broadcast when it is a revoke; [] for anything else
    (only a JSON body is ever decoded)."""
    if message.properties.get("content_type") != ACCEPTED_CONTENT_TYPE:
        return []
    try:
        command = json.loads(bytes(message.body))
    except (ValueError, UnicodeDecodeError):
        return []
    if not isinstance(command, dict) or command.get("method") != "revoke":
        return []
    task_ids = (command.get("arguments") or {}).get("task_id")
    task_ids = [task_ids] if isinstance(task_ids, str) else task_ids
    return [t for t in task_ids or [] if isinstance(t, str)]


def open_source(url: str, consumer: str, lease_timeout_s: float | None) -> AmqpCelerySource:
    config = parse_amqp_url(url)
    store = None
    if config.delivery_store is not None:
        from qworker.backends.redis.connection import redis_client

        store = redis_client(config.delivery_store)
    from qworker.backends.urls import query_params

    return AmqpCelerySource(
        config,
        consumer=consumer,
        lease_timeout_s=lease_timeout_s or url_number(query_params(url), "lease_timeout_s", 30.0),
        delivery_store=store,
    )
