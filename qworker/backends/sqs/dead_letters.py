"""The dead letters of an SQS queue: its dead-letter queue (the `dead_letter` URL parameter, else
the queue's RedrivePolicy target, else `{queue}-dlq`); the id is the dead letter's MessageId. SQS
cannot peek, so reading receives every message and makes it visible again at once."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from qworker.backends.aws import aws_client, aws_parts
from qworker.backends.dead_letters import (
    DEFAULT_LIST_LIMIT,
    DeadLetter,
    DeadLetterQueue,
    clear_before_replay,
    with_replay_id,
)
from qworker.backends.sink import ResultSink
from qworker.backends.sqs.layout import ATTR_JOB_ID, dead_letter_queue_name, queue_url, redrive_policy

# How long an SQS dead letter stays invisible while it is being read (it is made visible again
# right after; this only bounds the time if the reader dies in between).
SQS_READ_VISIBILITY_S = 30


class SqsDeadLetters(DeadLetterQueue):
    def __init__(self, sqs: Any, *, queue: str, dead_letter_queue: str | None) -> None:
        self.sqs = sqs
        self.queue = queue
        self.queue_url = queue_url(sqs, queue)
        self.is_fifo = queue.endswith(".fifo")
        if dead_letter_queue is None:
            attrs = sqs.get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=["RedrivePolicy"])
            redrive = redrive_policy(attrs.get("Attributes") or {})
            dead_letter_queue = redrive.target if redrive is not None else None
        self.dead_letter_queue = dead_letter_queue or dead_letter_queue_name(queue)
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
        wanted = None if dead_letter_ids is None else set(dead_letter_ids)
        messages = self._receive_all(DEFAULT_LIST_LIMIT)
        chosen = [m for m in messages if wanted is None or m["MessageId"] in wanted]
        self._give_back([m for m in messages if m not in chosen])
        replayed = []
        for message in chosen:
            letter = with_replay_id(self._dead_letter(message))
            clear_before_replay(results, letter)
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


def open_dead_letters(url: str) -> SqsDeadLetters:
    queue, _, params = aws_parts(url)
    return SqsDeadLetters(aws_client("sqs", params), queue=queue, dead_letter_queue=params.get("dead_letter"))
