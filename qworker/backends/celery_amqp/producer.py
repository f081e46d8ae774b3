"""The sending side of a Celery queue on RabbitMQ: Celery protocol v2 messages (JSON, persistent),
as `app.send_task("qworker.generate", kwargs=job, queue=...)` sends them, with publisher confirms.

A job's priority (lower runs first, as everywhere in qworker) becomes the message's AMQP priority
(higher first) on a queue with x-max-priority: -priority, clamped to 0..max_priority, so the
default 0 is the lowest and an urgent job (priority -5) is delivered before it.
"""

from __future__ import annotations

import json
from typing import Any

from qworker.backends.celery.keys import TASK_NAME
from qworker.backends.celery_amqp.broker import AmqpBroker
from qworker.backends.celery_amqp.url import AmqpQueue, parse_amqp_url
from qworker.backends.source import JobProducer, OutgoingJob


def amqp_priority(job_priority: int, max_priority: int | None) -> int | None:
    if max_priority is None:
        return None
    return max(0, min(max_priority, -job_priority))


def celery_message(job: OutgoingJob, max_priority: int | None) -> Any:
    import amqp  # type: ignore[import-untyped]

    headers = {
        "lang": "py",
        "task": TASK_NAME,
        "id": job.job_id,
        "root_id": job.job_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "eta": None,
        "expires": None,
        "timelimit": [None, None],
        "argsrepr": "()",
        "kwargsrepr": "{...}",
        "origin": "qworker",
    }
    body = [[], json.loads(job.body), {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    properties: dict[str, Any] = {
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "application_headers": headers,
        "correlation_id": job.job_id,
        "delivery_mode": 2,
    }
    priority = amqp_priority(job.priority, max_priority)
    if priority is not None:
        properties["priority"] = priority
    return amqp.Message(json.dumps(body).encode(), **properties)


class AmqpCeleryProducer(JobProducer):
    def __init__(self, config: AmqpQueue) -> None:
        self.config = config
        self.broker = AmqpBroker(config)
        # Declared now, so that the queue (and its dead-letter exchange) exist before a send.
        self.broker.call("connecting", lambda channel: None)

    def send(self, jobs: list[OutgoingJob]) -> list[str]:
        queue = self.config.queue
        for job in jobs:
            message = celery_message(job, self.config.max_priority)
            self.broker.call(
                "publishing",
                lambda ch, m=message: ch.basic_publish_confirm(m, exchange=queue, routing_key=queue),  # type: ignore[misc]
            )
        return [job.job_id for job in jobs]

    def queue_depth(self) -> int | None:
        """Messages ready (AMQP's declare-ok counts no unacked ones; see backlog.py for those)."""
        return int(
            self.broker.call(
                "reading depth", lambda ch: ch.queue_declare(self.config.queue, passive=True)
            ).message_count
        )

    def close(self) -> None:
        self.broker.close()


def open_producer(url: str, payload_location: str | None) -> AmqpCeleryProducer:
    return AmqpCeleryProducer(parse_amqp_url(url))
