"""Dead-letter queues, for operators: list, show, replay and purge what a worker dead-lettered.

One class per queue backend, chosen by the queue URL's scheme (DEAD_LETTER_BACKENDS, like the
backends table in connections.py):

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
import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from qworker.worker import constants
from qworker.worker.connections import (
    InvalidURLError,
    aws_client,
    aws_parts,
    parse_redis_url,
    redis_client,
    resolve_url,
    schemes_text,
)
from qworker.worker.jobs import JobStatus
from qworker.worker.sinks.base import ResultSink

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
    """Remove the job's stored result, its deltas and last error when the result is a failure, so
    that a replayed job runs. Returns whether a failed result was removed."""
    from qworker.worker.sinks.celery import CeleryResultSink
    from qworker.worker.sinks.redis import RedisResultSink
    from qworker.worker.sinks.s3 import S3ResultSink
    from qworker.worker.sinks.split import SplitSink

    if isinstance(sink, SplitSink):
        is_cleared = clear_failed_result(sink.final, job_id)
        if is_cleared:
            clear_failed_result(sink.stream, job_id)
        return is_cleared
    result = sink.get_result(job_id)
    if result is not None and result.status is not JobStatus.FAILED:
        return False
    if isinstance(sink, RedisResultSink):
        keys = [
            constants.delta_stream_key(sink.prefix, job_id),
            constants.last_error_key(sink.prefix, job_id),
            constants.result_key(sink.prefix, job_id),
        ]
        if isinstance(sink, CeleryResultSink):
            keys.append(sink.meta_key(job_id))
        sink.redis.delete(*keys)
    elif isinstance(sink, S3ResultSink):
        sink.s3.delete_object(Bucket=sink.bucket, Key=sink.key(job_id))
    else:
        raise TypeError(f"cannot remove results from a {type(sink).__name__}")
    return result is not None


def _clear_before_replay(results: ResultSink | None, letter: DeadLetter) -> None:
    if results is not None and letter.job_id is not None:
        clear_failed_result(results, letter.job_id)


# -- Redis Streams ---------------------------------------------------------------------------


class RedisStreamDeadLetters(DeadLetterQueue):
    def __init__(self, redis: Any, *, stream: str, dead_letter_stream: str) -> None:
        self.redis = redis
        self.stream = stream
        self.dead_letter_stream = dead_letter_stream

    @staticmethod
    def _dead_letter(entry_id: Any, fields: dict[Any, Any]) -> DeadLetter:
        def text(name: str) -> str | None:
            value = fields.get(name.encode(), fields.get(name))
            if value is None:
                return None
            return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)

        entry = text_id(entry_id)
        body = fields.get(constants.FIELD_BODY.encode(), fields.get(constants.FIELD_BODY, b""))
        return DeadLetter(
            id=entry,
            job_id=text(constants.FIELD_JOB_ID),
            reason=text("reason") or "",
            attempts=int(text("delivery_count") or 0),
            dead_at=int(entry.split("-")[0]) / 1000.0,
            body=body if isinstance(body, bytes) else str(body).encode(),
            source=text("source_stream"),
        )

    def read(self, limit: int = DEFAULT_LIST_LIMIT) -> list[DeadLetter]:
        entries = self.redis.xrange(self.dead_letter_stream, count=limit)
        return [self._dead_letter(entry_id, fields) for entry_id, fields in entries]

    def show(self, dead_letter_id: str) -> DeadLetter | None:
        import redis

        try:
            entries = self.redis.xrange(self.dead_letter_stream, dead_letter_id, dead_letter_id)
        except redis.ResponseError:  # not a stream entry id
            return None
        return self._dead_letter(*entries[0]) if entries else None

    def replay(self, dead_letter_ids: Iterable[str] | None, results: ResultSink | None) -> list[DeadLetter]:
        if dead_letter_ids is None:
            letters = self.read()
        else:
            letters = [d for d in (self.show(i) for i in dead_letter_ids) if d is not None]
        for letter in letters:
            _clear_before_replay(results, letter)
            fields: dict[str, Any] = {constants.FIELD_BODY: letter.body}
            if letter.job_id is not None:
                fields = {constants.FIELD_JOB_ID: letter.job_id, **fields}
            # Back to the lane it came from; anything else (a dead letter from an older stream
            # name) to the stream.
            high_lane = constants.high_lane_stream(self.stream)
            target = high_lane if letter.source == high_lane else self.stream
            pipe = self.redis.pipeline(transaction=True)
            pipe.xadd(target, fields)
            pipe.xdel(self.dead_letter_stream, letter.id)
            pipe.execute()
        return letters

    def purge(self) -> int:
        count = int(self.redis.xlen(self.dead_letter_stream))
        self.redis.delete(self.dead_letter_stream)
        return count

    def close(self) -> None:
        self.redis.close()


def text_id(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def open_redis(url: str) -> RedisStreamDeadLetters:
    from qworker.worker.sources.redis_streams import URL_PARAMS

    parsed = parse_redis_url(url, URL_PARAMS)
    stream = parsed.params.get("stream", constants.DEFAULT_STREAM)
    return RedisStreamDeadLetters(
        redis_client(parsed.connection_url),
        stream=stream,
        dead_letter_stream=parsed.params.get("dead_letter", constants.dead_letter_stream(stream)),
    )


# -- SQS -------------------------------------------------------------------------------------


class SqsDeadLetters(DeadLetterQueue):
    def __init__(self, sqs: Any, *, queue: str, dead_letter_queue: str | None) -> None:
        from qworker.worker.sources.sqs import _queue_url

        self.sqs = sqs
        self.queue = queue
        self.queue_url = _queue_url(sqs, queue)
        self.is_fifo = queue.endswith(".fifo")
        if dead_letter_queue is None:
            attrs = sqs.get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=["RedrivePolicy"])
            policy = (attrs.get("Attributes") or {}).get("RedrivePolicy")
            if policy:
                dead_letter_queue = str(json.loads(policy)["deadLetterTargetArn"]).rsplit(":", 1)[-1]
        if dead_letter_queue is None:
            base = queue.removesuffix(".fifo")
            dead_letter_queue = f"{base}-dlq.fifo" if self.is_fifo else f"{base}-dlq"
        self.dead_letter_queue = dead_letter_queue
        self._dead_letter_url: str | None = None

    def _dlq_url(self) -> str | None:
        from botocore.exceptions import ClientError

        if self._dead_letter_url is None:
            try:
                self._dead_letter_url = self.sqs.get_queue_url(QueueName=self.dead_letter_queue)["QueueUrl"]
            except ClientError:
                return None  # never created: no dead letters
        return self._dead_letter_url

    def _receive_all(self, limit: int) -> list[dict[str, Any]]:
        """Every message of the dead-letter queue (up to `limit`), held invisible."""
        url = self._dlq_url()
        if url is None:
            return []
        messages: dict[str, dict[str, Any]] = {}
        while len(messages) < limit:
            reply = self.sqs.receive_message(
                QueueUrl=url,
                MaxNumberOfMessages=10,
                WaitTimeSeconds=0,
                VisibilityTimeout=SQS_READ_VISIBILITY_S,
                MessageSystemAttributeNames=["SentTimestamp", "MessageGroupId"],
                MessageAttributeNames=["All"],
            )
            batch = reply.get("Messages") or []
            if not batch:
                break
            for message in batch:
                messages[message["MessageId"]] = message
        return sorted(
            messages.values(), key=lambda m: int((m.get("Attributes") or {}).get("SentTimestamp", 0))
        )

    def _give_back(self, messages: list[dict[str, Any]]) -> None:
        url = self._dlq_url()
        for start in range(0, len(messages), 10):
            chunk = messages[start : start + 10]
            if chunk and url is not None:
                self.sqs.change_message_visibility_batch(
                    QueueUrl=url,
                    Entries=[
                        {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"], "VisibilityTimeout": 0}
                        for i, m in enumerate(chunk)
                    ],
                )

    @staticmethod
    def _dead_letter(message: dict[str, Any]) -> DeadLetter:
        from qworker.worker.sources.sqs import ATTR_JOB_ID

        attributes = message.get("MessageAttributes") or {}

        def attribute(name: str) -> str | None:
            value = attributes.get(name, {}).get("StringValue")
            return str(value) if value is not None else None

        sent_ms = (message.get("Attributes") or {}).get("SentTimestamp")
        return DeadLetter(
            id=message["MessageId"],
            job_id=attribute(ATTR_JOB_ID),
            reason=attribute("reason") or "(moved by the queue's RedrivePolicy)",
            attempts=int(attribute("receive_count") or 0),
            dead_at=int(sent_ms) / 1000.0 if sent_ms else None,
            body=message["Body"].encode(),
        )

    def read(self, limit: int = DEFAULT_LIST_LIMIT) -> list[DeadLetter]:
        messages = self._receive_all(limit)
        self._give_back(messages)
        return [self._dead_letter(m) for m in messages]

    def replay(self, dead_letter_ids: Iterable[str] | None, results: ResultSink | None) -> list[DeadLetter]:
        from qworker.worker.sources.sqs import ATTR_JOB_ID

        wanted = None if dead_letter_ids is None else set(dead_letter_ids)
        messages = self._receive_all(DEFAULT_LIST_LIMIT)
        chosen = [m for m in messages if wanted is None or m["MessageId"] in wanted]
        self._give_back([m for m in messages if m not in chosen])
        replayed = []
        for message in chosen:
            letter = self._dead_letter(message)
            _clear_before_replay(results, letter)
            args: dict[str, Any] = {"QueueUrl": self.queue_url, "MessageBody": message["Body"]}
            if letter.job_id is not None:
                args["MessageAttributes"] = {
                    ATTR_JOB_ID: {"DataType": "String", "StringValue": letter.job_id}
                }
            if self.is_fifo:
                group = (message.get("Attributes") or {}).get("MessageGroupId")
                args["MessageGroupId"] = group or letter.job_id or "replay"
                # Not the job id: the queue would drop a replay within its deduplication window.
                args["MessageDeduplicationId"] = uuid.uuid4().hex
            self.sqs.send_message(**args)
            self.sqs.delete_message(QueueUrl=self._dlq_url(), ReceiptHandle=message["ReceiptHandle"])
            replayed.append(letter)
        return replayed

    def purge(self) -> int:
        messages = self._receive_all(DEFAULT_LIST_LIMIT)
        for message in messages:
            self.sqs.delete_message(QueueUrl=self._dlq_url(), ReceiptHandle=message["ReceiptHandle"])
        return len(messages)

    def close(self) -> None:
        self.sqs.close()


def open_sqs(url: str) -> SqsDeadLetters:
    queue, _, params = aws_parts(url)
    return SqsDeadLetters(aws_client("sqs", params), queue=queue, dead_letter_queue=params.get("dead_letter"))


# -- Celery ----------------------------------------------------------------------------------


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
        from qworker.worker.sources.celery import ACCEPTED_CONTENT_TYPE, CelerySource

        envelope = record.get("envelope") or {}
        body = b""
        if isinstance(envelope.get("body"), str):
            import base64

            body = base64.b64decode(envelope["body"]) if _is_base64(envelope) else envelope["body"].encode()
            if envelope.get("content-type") == ACCEPTED_CONTENT_TYPE:
                # The job, as the worker reads it out of Celery's [args, kwargs, embed].
                job_body, problem = CelerySource._job_body(body)
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
            _clear_before_replay(results, letter)
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


def open_celery(url: str) -> CeleryDeadLetters:
    from qworker.worker.connections import CELERY_PARAMS, celery_broker_url, parse_url

    parsed = parse_url(url, CELERY_PARAMS)
    queue = parsed.params.get("queue", "qworker")
    return CeleryDeadLetters(
        redis_client(celery_broker_url(parsed.connection_url)),
        queue=queue,
        dead_letter_list=parsed.params.get("dead_letter") or f"{queue}.dead",
    )


# URL scheme -> the function that opens that queue's dead letters.
DEAD_LETTER_BACKENDS = {
    "redis": open_redis,
    "rediss": open_redis,
    "unix": open_redis,
    "sqs": open_sqs,
    "celery+redis": open_celery,
    "celery+rediss": open_celery,
}


def open_dead_letters(url: str | None) -> DeadLetterQueue:
    """The dead letters of the job queue at `url` (none: the embedded Redis)."""
    url = resolve_url(url)
    scheme = urlsplit(url).scheme
    opener = DEAD_LETTER_BACKENDS.get(scheme)
    if opener is None:
        raise InvalidURLError(
            f"no dead-letter queue for {scheme or '(no scheme)'}:// queues; "
            f"use {schemes_text(DEAD_LETTER_BACKENDS)}"
        )
    return opener(url)
