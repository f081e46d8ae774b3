"""The dead letters of a Celery queue on RabbitMQ: the queue `{queue}.dead` behind the dead-letter
exchange of the same name. qworker's dead letters carry the reason in x-qworker-reason; a quorum
queue's messages past x-delivery-limit carry RabbitMQ's x-death instead. The id is the task id.

Reading takes the messages with basic.get and no ack, then closes the channel, so RabbitMQ puts
them back in their order. Replay publishes the original body and properties (qworker's and
RabbitMQ's dead-letter headers removed) to the job queue, with publisher confirms, then acks the
dead letter; purge is queue.purge.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qworker.backends.celery.source import ACCEPTED_CONTENT_TYPE, CelerySource
from qworker.backends.celery_amqp.broker import AmqpBroker
from qworker.backends.celery_amqp.source import DEAD_AT_HEADER, DELIVERY_COUNT_HEADER, REASON_HEADER
from qworker.backends.celery_amqp.url import AmqpQueue, parse_amqp_url
from qworker.backends.dead_letters import (
    DEFAULT_LIST_LIMIT,
    DeadLetter,
    DeadLetterQueue,
    clear_before_replay,
)
from qworker.backends.sink import ResultSink

# Headers a dead letter gets on its way here, dropped when it goes back to the job queue.
_DEAD_HEADERS = {
    REASON_HEADER,
    DELIVERY_COUNT_HEADER,
    DEAD_AT_HEADER,
    "x-death",
    "x-delivery-count",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
}


def dead_letter_of(index: int, message: Any) -> DeadLetter:
    headers = dict(message.properties.get("application_headers") or {})
    task_id = headers.get("id") if isinstance(headers.get("id"), str) else None
    reason = headers.get(REASON_HEADER)
    attempts = headers.get(DELIVERY_COUNT_HEADER)
    if reason is None:
        deaths = headers.get("x-death") or [{}]
        reason = f"RabbitMQ dead-lettered it ({deaths[0].get('reason', 'unknown')}, x-death)"
        # RabbitMQ drops x-delivery-count when it dead-letters: 0 when the count is unknown.
        attempts = int(headers["x-delivery-count"]) + 1 if "x-delivery-count" in headers else 0
    body = bytes(message.body)
    if message.properties.get("content_type") == ACCEPTED_CONTENT_TYPE:
        job_body, problem = CelerySource.job_body(body)
        body = body if problem is not None else job_body
    dead_at = headers.get(DEAD_AT_HEADER)
    return DeadLetter(
        id=task_id or f"#{index}",
        job_id=task_id,
        reason=str(reason),
        attempts=int(attempts or 0),
        dead_at=float(dead_at) if isinstance(dead_at, (int, float)) else None,
        body=body,
    )


class AmqpDeadLetters(DeadLetterQueue):
    def __init__(self, config: AmqpQueue) -> None:
        self.config = config
        self.broker = AmqpBroker(config)

    def _take(self, limit: int) -> list[Any]:
        dead = self.config.dead_letter
        messages: list[Any] = []
        while len(messages) < limit:
            message = self.broker.call("reading dead letters", lambda ch: ch.basic_get(dead, no_ack=False))
            if message is None:
                break
            messages.append(message)
        return messages

    def read(self, limit: int = DEFAULT_LIST_LIMIT) -> list[DeadLetter]:
        try:
            return [dead_letter_of(i, m) for i, m in enumerate(self._take(limit))]
        finally:
            self.broker.reset()  # what was read goes back, in order

    def replay(self, dead_letter_ids: Iterable[str] | None, results: ResultSink | None) -> list[DeadLetter]:
        import amqp  # type: ignore[import-untyped]

        wanted = None if dead_letter_ids is None else set(dead_letter_ids)
        queue = self.config.queue
        replayed = []
        try:
            for i, message in enumerate(self._take(DEFAULT_LIST_LIMIT)):
                letter = dead_letter_of(i, message)
                if wanted is not None and letter.id not in wanted:
                    continue
                properties = dict(message.properties)
                headers = dict(properties.get("application_headers") or {})
                properties["application_headers"] = {
                    k: v for k, v in headers.items() if k not in _DEAD_HEADERS
                }
                copy = amqp.Message(bytes(message.body), **properties)
                clear_before_replay(results, letter)
                tag = message.delivery_info["delivery_tag"]
                self.broker.call(
                    "replaying",
                    lambda ch, m=copy: ch.basic_publish_confirm(m, exchange=queue, routing_key=queue),  # type: ignore[misc]
                )
                self.broker.call("replaying", lambda ch, t=tag: ch.basic_ack(t))  # type: ignore[misc]
                replayed.append(letter)
            # A round trip, so that the acks are processed before the channel closes.
            self.broker.call("replaying", lambda ch: ch.queue_declare(self.config.dead_letter, passive=True))
        finally:
            self.broker.reset()
        return replayed

    def purge(self) -> int:
        return int(self.broker.call("purging", lambda ch: ch.queue_purge(self.config.dead_letter)) or 0)

    def close(self) -> None:
        self.broker.close()


def open_dead_letters(url: str) -> AmqpDeadLetters:
    return AmqpDeadLetters(parse_amqp_url(url))
