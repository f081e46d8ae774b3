"""The dead letters of a Celery queue: the list `{queue}.dead` of JSON records (reason, task id,
the broker's envelope); the id is the task id."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterable
from typing import Any

from qworker.backends.celery import keys
from qworker.backends.celery.source import ACCEPTED_CONTENT_TYPE, CelerySource
from qworker.backends.celery.url import parse_celery_redis_url
from qworker.backends.dead_letters import (
    DEFAULT_LIST_LIMIT,
    DeadLetter,
    DeadLetterQueue,
    clear_before_replay,
)
from qworker.backends.redis.connection import redis_client
from qworker.backends.sink import ResultSink


class CeleryDeadLetters(DeadLetterQueue):
    """The list `{queue}.dead`, newest first as the worker pushes them."""

    def __init__(self, redis: Any, *, queue: str, dead_letter_list: str) -> None:
        self.redis = redis
        self.queue = queue
        self.dead_letter_list = dead_letter_list

    def _records(self, limit: int) -> list[tuple[bytes, dict[str, Any]]]:
        raws = self.redis.lrange(self.dead_letter_list, -limit, -1)
        # Oldest first: the list is LPUSHed.
        return [(raw, json.loads(raw)) for raw in reversed(raws)]

    @staticmethod
    def _dead_letter(index: int, record: dict[str, Any]) -> DeadLetter:
        envelope = record.get("envelope") or {}
        body = b""
        if isinstance(envelope.get("body"), str):
            body = base64.b64decode(envelope["body"]) if _is_base64(envelope) else envelope["body"].encode()
            if envelope.get("content-type") == ACCEPTED_CONTENT_TYPE:
                # The job, as the worker reads it out of Celery's [args, kwargs, embed].
                job_body, problem = CelerySource.job_body(body)
                body = body if problem is not None else job_body
        return DeadLetter(
            id=record.get("task_id") or f"#{index}",
            job_id=record.get("task_id"),
            reason=str(record.get("reason") or ""),
            attempts=int(record.get("delivery_count") or 0),
            dead_at=record.get("dead_at"),
            body=body,
        )

    def read(self, limit: int = DEFAULT_LIST_LIMIT) -> list[DeadLetter]:
        return [self._dead_letter(i, record) for i, (_, record) in enumerate(self._records(limit))]

    def replay(self, dead_letter_ids: Iterable[str] | None, results: ResultSink | None) -> list[DeadLetter]:
        wanted = None if dead_letter_ids is None else set(dead_letter_ids)
        replayed = []
        for i, (raw, record) in enumerate(self._records(DEFAULT_LIST_LIMIT)):
            letter = self._dead_letter(i, record)
            if wanted is not None and letter.id not in wanted:
                continue
            envelope = record.get("envelope")
            if not isinstance(envelope, dict):
                continue  # nothing to put back
            properties = dict(envelope.get("properties") or {})
            # A new delivery tag: the old one named the acked message in kombu's unacked hash.
            properties["delivery_tag"] = str(uuid.uuid4())
            envelope = {**envelope, "properties": properties}
            clear_before_replay(results, letter)
            pipe = self.redis.pipeline(transaction=True)
            # kombu's Redis transport: a queue is a list, LPUSHed by the producer, popped from the right.
            pipe.lpush(self.queue, json.dumps(envelope))
            pipe.lrem(self.dead_letter_list, 1, raw)
            pipe.execute()
            replayed.append(letter)
        return replayed

    def purge(self) -> int:
        count = int(self.redis.llen(self.dead_letter_list))
        self.redis.delete(self.dead_letter_list)
        return count

    def close(self) -> None:
        self.redis.close()


def _is_base64(envelope: dict[str, Any]) -> bool:
    return (envelope.get("properties") or {}).get("body_encoding") == "base64"


def open_dead_letters(url: str) -> CeleryDeadLetters:
    redis_url, params = parse_celery_redis_url(url)
    queue = params.get("queue", keys.DEFAULT_QUEUE)
    return CeleryDeadLetters(
        redis_client(redis_url),
        queue=queue,
        dead_letter_list=params.get("dead_letter") or keys.dead_letter_list(queue),
    )
