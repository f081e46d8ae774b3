"""The sending side of a Celery queue: jobs as Celery protocol v2 messages (JSON), as
`app.send_task("qworker.generate", kwargs=job, queue=...)` would send them."""

from __future__ import annotations

import json

from qworker.backends.celery import keys
from qworker.backends.celery.url import parse_celery_url
from qworker.backends.source import JobProducer, OutgoingJob


class CeleryProducer(JobProducer):
    """Sends jobs as Celery protocol v2 messages (JSON), as `app.send_task` would."""

    def __init__(self, broker_url: str, *, queue: str = keys.DEFAULT_QUEUE) -> None:
        from kombu import Connection, Exchange, Queue

        self.queue = queue
        self.connection = Connection(broker_url)
        self.kqueue = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
        self.producer = self.connection.Producer()

    def send(self, jobs: list[OutgoingJob]) -> list[str]:
        for job in jobs:
            kwargs = json.loads(job.body)
            headers = {
                "lang": "py",
                "task": keys.TASK_NAME,
                "id": job.job_id,
                "root_id": job.job_id,
                "parent_id": None,
                "group": None,
                "retries": 0,
                "eta": None,
                "expires": None,
                "argsrepr": "()",
                "kwargsrepr": "{...}",
                "origin": "qworker",
            }
            self.producer.publish(
                [[], kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}],
                serializer="json",
                headers=headers,
                exchange=self.kqueue.exchange,
                routing_key=self.queue,
                declare=[self.kqueue],
                correlation_id=job.job_id,
            )
        return [job.job_id for job in jobs]

    def queue_depth(self) -> int | None:
        with self.connection.channel() as channel:
            return int(channel._size(self.queue))

    def close(self) -> None:
        self.connection.release()


def open_producer(url: str, payload_location: str | None) -> CeleryProducer:
    broker_url, params = parse_celery_url(url)
    return CeleryProducer(broker_url, queue=params.get("queue", keys.DEFAULT_QUEUE))
