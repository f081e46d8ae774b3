"""The backlog of an SQS queue, from its approximate counters (SQS cannot show a body without
receiving it): see ../backlog.py for what each term means."""

from __future__ import annotations

from typing import Any

from qworker.backends.aws import aws_client, aws_parts
from qworker.backends.backlog import Backlog, QueueWork
from qworker.pool.demand import PoolSizing, extrapolate


class SqsBacklog:
    def __init__(self, sqs: Any, sizing: PoolSizing, *, queue: str) -> None:
        self.sqs = sqs
        self.sizing = sizing
        self.queue_url = queue if queue.startswith("http") else sqs.get_queue_url(QueueName=queue)["QueueUrl"]

    def read(self, live_workers: set[str] | None) -> QueueWork:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesDelayed",
                "ApproximateNumberOfMessagesNotVisible",
            ],
        )["Attributes"]
        num_waiting = int(attrs.get("ApproximateNumberOfMessages", 0)) + int(
            attrs.get("ApproximateNumberOfMessagesDelayed", 0)
        )
        num_in_flight = int(attrs.get("ApproximateNumberOfMessagesNotVisible", 0))
        return QueueWork(
            extrapolate([], num_waiting, self.sizing), extrapolate([], num_in_flight, self.sizing)
        )

    def close(self) -> None:
        self.sqs.close()


def open_backlog(url: str, sizing: PoolSizing, lease_timeout_s: float | None) -> Backlog:
    queue, _, params = aws_parts(url)
    return SqsBacklog(aws_client("sqs", params), sizing, queue=queue)
