"""The SQS backend's message layout and queue names, shared by its source, producer and
dead-letter tools.

Message layout: body = the job JSON, or `{"s3_payload": "s3://bucket/key"}` for a job too large for
the queue; message attribute `qworker_id` = the job id. The dead-letter queue is the `dead_letter`
URL parameter, else the target of the queue's RedrivePolicy, else `{queue}-dlq` (`.fifo` kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

ATTR_JOB_ID = "qworker_id"
POINTER_FIELD = "s3_payload"
# SQS bounds.
MAX_BATCH = 10
MAX_WAIT_S = 20


@dataclass
class S3Location:
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> S3Location:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"not an s3://bucket/key URL: {url!r}")
        return cls(parts.netloc, parts.path.lstrip("/"))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class RedrivePolicy:
    # The dead-letter queue's name (the last part of its ARN).
    target: str
    max_receive_count: int


def redrive_policy(attributes: dict[str, Any]) -> RedrivePolicy | None:
    """The RedrivePolicy of a queue's attributes (GetQueueAttributes), if it has one."""
    raw = attributes.get("RedrivePolicy")
    if not raw:
        return None
    policy = json.loads(raw)
    target = str(policy["deadLetterTargetArn"]).rsplit(":", 1)[-1]
    return RedrivePolicy(target, int(policy["maxReceiveCount"]))


def dead_letter_queue_name(queue: str) -> str:
    """The dead-letter queue of `queue` when neither the URL nor a RedrivePolicy names one."""
    base = queue.removesuffix(".fifo")
    return f"{base}-dlq.fifo" if queue.endswith(".fifo") else f"{base}-dlq"


def queue_url(sqs: Any, name: str) -> str:
    from botocore.exceptions import ClientError

    try:
        return sqs.get_queue_url(QueueName=name)["QueueUrl"]
    except ClientError as exc:
        raise ValueError(f"SQS queue {name!r} not found ({exc}); create it first") from None
