"""The sending side of an SQS queue; a job too large for a message goes to S3 behind a pointer
(layout.py)."""

from __future__ import annotations

import json
from typing import Any

from qworker.backends.aws import aws_client, aws_parts
from qworker.backends.source import JobProducer, OutgoingJob
from qworker.backends.sqs.layout import ATTR_JOB_ID, MAX_BATCH, POINTER_FIELD, S3Location, queue_url

# Bytes kept below MaximumMessageSize for message attributes and batch overhead.
ENVELOPE_MARGIN = 4096


class SqsProducer(JobProducer):
    """Sends jobs to an SQS queue; a job too large for a message goes to S3 behind a pointer."""

    def __init__(self, sqs: Any, *, queue: str, s3: Any = None, payload_location: str | None = None) -> None:
        self.sqs = sqs
        self.s3 = s3
        self.queue = queue
        self.queue_url = queue_url(sqs, queue)
        self.is_fifo = queue.endswith(".fifo")
        attrs = sqs.get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=["MaximumMessageSize"])
        self.max_message_bytes = int(attrs["Attributes"].get("MaximumMessageSize", 262144))
        self.payload_location = S3Location.parse(payload_location) if payload_location else None

    def _body(self, job: OutgoingJob) -> str:
        if len(job.body) + len(job.job_id) + ENVELOPE_MARGIN <= self.max_message_bytes:
            return job.body.decode()
        if self.s3 is None or self.payload_location is None:
            raise ValueError(
                f"job {job.job_id} is {len(job.body)} bytes, over the queue's {self.max_message_bytes}-byte "
                "message limit, and no S3 payload location is set (payload_s3=s3://bucket/prefix "
                "in the queue URL, or an s3:// results URL)"
            )
        prefix = self.payload_location.key.strip("/")
        key = f"{prefix}/{job.job_id}.json" if prefix else f"{job.job_id}.json"
        self.s3.put_object(
            Bucket=self.payload_location.bucket, Key=key, Body=job.body, ContentType="application/json"
        )
        return json.dumps({POINTER_FIELD: f"s3://{self.payload_location.bucket}/{key}"})

    def send(self, jobs: list[OutgoingJob]) -> list[str]:
        entries = []
        for i, job in enumerate(jobs):
            entry: dict[str, Any] = {
                "Id": str(i),
                "MessageBody": self._body(job),
                "MessageAttributes": {ATTR_JOB_ID: {"DataType": "String", "StringValue": job.job_id}},
            }
            if self.is_fifo:
                entry["MessageGroupId"] = job.group_id or job.job_id
                entry["MessageDeduplicationId"] = job.job_id[:128]
            entries.append(entry)
        message_ids: list[str] = [""] * len(entries)
        batch: list[dict[str, Any]] = []
        batch_bytes = 0
        for entry in entries:
            size = len(entry["MessageBody"]) + ENVELOPE_MARGIN
            if batch and (len(batch) == MAX_BATCH or batch_bytes + size > self.max_message_bytes):
                self._send_batch(batch, message_ids)
                batch, batch_bytes = [], 0
            batch.append(entry)
            batch_bytes += size
        if batch:
            self._send_batch(batch, message_ids)
        return message_ids

    def _send_batch(self, batch: list[dict[str, Any]], message_ids: list[str]) -> None:
        reply = self.sqs.send_message_batch(QueueUrl=self.queue_url, Entries=batch)
        if reply.get("Failed"):
            raise RuntimeError(f"SQS refused {len(reply['Failed'])} jobs: {reply['Failed'][:3]}")
        for ok in reply.get("Successful") or []:
            message_ids[int(ok["Id"])] = ok["MessageId"]

    def queue_depth(self) -> int | None:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return int(attrs.get("ApproximateNumberOfMessages", 0)) + int(
            attrs.get("ApproximateNumberOfMessagesNotVisible", 0)
        )

    def close(self) -> None:
        self.sqs.close()
        if self.s3 is not None:
            self.s3.close()


def open_producer(url: str, payload_location: str | None) -> SqsProducer:
    queue, _, params = aws_parts(url)
    return SqsProducer(
        aws_client("sqs", params),
        queue=queue,
        s3=aws_client("s3", params),
        payload_location=params.get("payload_s3") or payload_location,
    )
