"""Job source on an AWS SQS queue (Standard or FIFO).

- lease: ReceiveMessage (long polling when the worker is idle) for min(10, admissible) messages,
  with the lease timeout as the visibility timeout.
- extend: ChangeMessageVisibilityBatch, every lease_timeout_s / 3 while the job runs (the
  heartbeat). An entry that fails (a stale receipt handle) is a lost lease.
- ack: DeleteMessage, after the result is stored (and the S3 payload object, if any, is deleted).
- release: ChangeMessageVisibility to 0, so that a peer receives the message at once.
- dead_letter: SendMessage to the dead-letter queue with the reason as a message attribute, then
  DeleteMessage. The dead-letter queue is the `dead_letter` URL parameter, else the target of the
  queue's RedrivePolicy, else `{queue}-dlq` (created on first use).
- delivery count: ApproximateReceiveCount. With a RedrivePolicy, SQS itself moves a message after
  maxReceiveCount receives, without a reason; `max_deliveries` tells the worker, which then
  dead-letters (with a reason and a failed result) one delivery earlier.

Message layout: body = the job JSON, or `{"s3_payload": "s3://bucket/key"}` for a job too large for
the queue; message attribute `qworker_id` = the job id. On FIFO queues the producer sets
MessageGroupId (default: the job id, so jobs do not block each other) and
MessageDeduplicationId = the job id; dead letters keep the MessageGroupId.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from qworker.backends.aws import aws_client, aws_parts
from qworker.backends.source import JobSource, Lease
from qworker.backends.sqs.errors import translate_error
from qworker.backends.sqs.layout import (
    ATTR_JOB_ID,
    MAX_BATCH,
    MAX_WAIT_S,
    POINTER_FIELD,
    S3Location,
    dead_letter_queue_name,
    queue_url,
    redrive_policy,
)
from qworker.backends.urls import url_number
from qworker.errors import TransientBrokerError

logger = logging.getLogger(__name__)
# After a receive without wait came back empty, skip receives without wait for this long: a
# worker that holds jobs asks for more between engine steps, and an HTTP call per step would
# slow every running job.
EMPTY_RECEIVE_BACKOFF_S = 0.25


def _pointer(body: bytes) -> S3Location | None:
    """The S3 location when `body` is a payload pointer (a small JSON object with one field)."""
    if len(body) > 2048 or POINTER_FIELD.encode() not in body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict) and set(data) == {POINTER_FIELD} and isinstance(data[POINTER_FIELD], str):
        try:
            return S3Location.parse(data[POINTER_FIELD])
        except ValueError:
            return None
    return None


class SqsSource(JobSource):
    def __init__(
        self,
        sqs: Any,
        *,
        queue: str,
        s3: Any = None,
        dead_letter_queue: str | None = None,
        lease_timeout_s: float | None = None,
    ) -> None:
        self.sqs = sqs
        self.s3 = s3
        self.queue = queue
        self.queue_url = queue_url(sqs, queue)
        self.queue_name = f"sqs:{queue}"
        self.is_fifo = queue.endswith(".fifo")
        attrs = sqs.get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=["All"])["Attributes"]
        self.lease_timeout_s = float(lease_timeout_s or attrs.get("VisibilityTimeout", 30))
        redrive = redrive_policy(attrs)
        self.max_deliveries = redrive.max_receive_count if redrive is not None else None
        if dead_letter_queue is None and redrive is not None:
            dead_letter_queue = redrive.target
        self.dead_letter_queue = dead_letter_queue or dead_letter_queue_name(queue)
        self._dead_letter_url: str | None = None
        # message id -> S3 payload object, deleted with the message.
        self._payloads: dict[str, S3Location] = {}
        # message id -> FIFO MessageGroupId, kept when the message is dead-lettered.
        self._group_ids: dict[str, str] = {}
        self._skip_empty_until = 0.0

    # -- lease -------------------------------------------------------------------------------

    def lease(self, max_count: int, block_s: float, *, is_idle: bool = True) -> list[Lease]:
        if max_count <= 0:
            return []
        if block_s <= 0 and time.monotonic() < self._skip_empty_until:
            return []
        wait_s = 0 if block_s <= 0 else min(MAX_WAIT_S, max(1, round(block_s)))
        reply = self.sqs.receive_message(
            QueueUrl=self.queue_url,
            MaxNumberOfMessages=min(MAX_BATCH, max_count),
            WaitTimeSeconds=wait_s,
            VisibilityTimeout=math.ceil(self.lease_timeout_s),
            MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp", "MessageGroupId"],
            MessageAttributeNames=["All"],
        )
        messages = reply.get("Messages") or []
        if not messages and block_s <= 0:
            self._skip_empty_until = time.monotonic() + EMPTY_RECEIVE_BACKOFF_S
        return [self._make_lease(m) for m in messages]

    def _make_lease(self, message: dict[str, Any]) -> Lease:
        attrs = message.get("Attributes") or {}
        job_id = (message.get("MessageAttributes") or {}).get(ATTR_JOB_ID, {}).get("StringValue")
        sent_ms = attrs.get("SentTimestamp")
        lease = Lease(
            message_id=message["MessageId"],
            body=message["Body"].encode(),
            job_id=job_id,
            delivery_count=int(attrs.get("ApproximateReceiveCount", 1)),
            enqueued_at=int(sent_ms) / 1000.0 if sent_ms else None,
            handle=message["ReceiptHandle"],
        )
        if attrs.get("MessageGroupId"):
            self._group_ids[lease.message_id] = attrs["MessageGroupId"]
        location = _pointer(lease.body)
        if location is not None:
            self._resolve_pointer(lease, location)
        return lease

    def _resolve_pointer(self, lease: Lease, location: S3Location) -> None:
        if self.s3 is None:
            lease.rejection = f"job body is an S3 pointer ({location}) and this worker has no S3 client"
            return
        try:
            lease.body = self.s3.get_object(Bucket=location.bucket, Key=location.key)["Body"].read()
        except Exception as exc:
            if isinstance(translate_error(exc), TransientBrokerError):
                raise  # S3 is away, not the job at fault: its message comes back after the lease
            # A missing object or a denied read: the job cannot run anywhere.
            lease.rejection = f"cannot read the job payload {location}: {exc}"
            lease.body = b""
            return
        self._payloads[lease.message_id] = location

    # -- holding and letting go --------------------------------------------------------------

    def _change_visibility(self, leases: list[Lease], timeout_s: int) -> list[Lease]:
        lost = []
        for start in range(0, len(leases), MAX_BATCH):
            chunk = leases[start : start + MAX_BATCH]
            reply = self.sqs.change_message_visibility_batch(
                QueueUrl=self.queue_url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": le.handle, "VisibilityTimeout": timeout_s}
                    for i, le in enumerate(chunk)
                ],
            )
            for failure in reply.get("Failed") or []:
                lost.append(chunk[int(failure["Id"])])
        return lost

    def extend(self, leases: list[Lease]) -> list[Lease]:
        return self._change_visibility(leases, math.ceil(self.lease_timeout_s))

    def ack(self, lease: Lease) -> None:
        self.sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=lease.handle)
        self._group_ids.pop(lease.message_id, None)
        location = self._payloads.pop(lease.message_id, None)
        if location is not None:
            try:
                self.s3.delete_object(Bucket=location.bucket, Key=location.key)
            except Exception:  # the job is done; a leftover payload object is only storage
                logger.warning("could not delete the payload object %s", location, exc_info=True)

    def release(self, leases: list[Lease]) -> None:
        if leases:
            self._change_visibility(leases, 0)
        for lease in leases:
            self._payloads.pop(lease.message_id, None)
            self._group_ids.pop(lease.message_id, None)

    def dead_letter(self, lease: Lease, reason: str) -> None:
        if self._dead_letter_url is None:
            self._dead_letter_url = self._ensure_dead_letter_queue()
        attributes = {
            "reason": {"DataType": "String", "StringValue": reason[:4096]},
            "source_queue": {"DataType": "String", "StringValue": self.queue},
            "source_message_id": {"DataType": "String", "StringValue": lease.message_id},
            "receive_count": {"DataType": "Number", "StringValue": str(lease.delivery_count)},
        }
        if lease.job_id:
            attributes[ATTR_JOB_ID] = {"DataType": "String", "StringValue": lease.job_id}
        args: dict[str, Any] = dict(
            QueueUrl=self._dead_letter_url, MessageBody=lease.body.decode(errors="replace") or "{}",
            MessageAttributes=attributes,
        )  # fmt: skip
        location = self._payloads.pop(lease.message_id, None)
        if location is not None:
            # Keep the pointer, not the payload: the dead letter must fit in a message.
            args["MessageBody"] = json.dumps({POINTER_FIELD: str(location)})
        if self._dead_letter_url.endswith(".fifo"):
            args["MessageGroupId"] = self._group_ids.get(lease.message_id) or lease.job_id or "dead"
            args["MessageDeduplicationId"] = lease.message_id
        self.sqs.send_message(**args)
        self.sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=lease.handle)
        self._group_ids.pop(lease.message_id, None)

    def _ensure_dead_letter_queue(self) -> str:
        from botocore.exceptions import ClientError

        try:
            return self.sqs.get_queue_url(QueueName=self.dead_letter_queue)["QueueUrl"]
        except ClientError:
            attributes = {"FifoQueue": "true"} if self.dead_letter_queue.endswith(".fifo") else {}
            logger.info("creating the dead-letter queue %s", self.dead_letter_queue)
            return self.sqs.create_queue(QueueName=self.dead_letter_queue, Attributes=attributes)["QueueUrl"]

    def close(self) -> None:
        self.sqs.close()
        if self.s3 is not None:
            self.s3.close()


def open_source(url: str, consumer: str, lease_timeout_s: float | None) -> SqsSource:
    queue, _, params = aws_parts(url)
    return SqsSource(
        aws_client("sqs", params),
        queue=queue,
        s3=aws_client("s3", params),
        dead_letter_queue=params.get("dead_letter"),
        # None: the queue's own VisibilityTimeout.
        lease_timeout_s=lease_timeout_s or (url_number(params, "lease_timeout_s", 0) or None),
    )
