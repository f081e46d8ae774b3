"""Shared parts of the Celery-on-RabbitMQ tests: the Celery `task_queues` of docs/WORKER.md, a
Celery app on a node, the qworker URLs, and raw AMQP helpers (py-amqp, kombu's transport)."""

from __future__ import annotations

import uuid
from typing import Any

import redis as redis_lib

from qworker.backends.celery_amqp.url import dead_letter_name
from qworker.testing.worker_kit import redis_base_url

RESULTS_REDIS = redis_base_url(12)
RESULTS = f"celery+{RESULTS_REDIS}"
TASK = "qworker.generate"


def results_redis() -> redis_lib.Redis | None:
    r = redis_lib.Redis.from_url(RESULTS_REDIS)
    try:
        r.ping()
    except redis_lib.RedisError:
        return None
    return r


def new_queue(kind: str) -> str:
    return f"qwtest-amqp-{kind}-{uuid.uuid4().hex[:8]}"


def task_queue(
    name: str, *, quorum: bool = False, max_priority: int | None = None, delivery_limit: int | None = None
):
    """The Celery queue qworker declares for the same URL parameters (docs/WORKER.md)."""
    from kombu import Exchange, Queue

    arguments: dict[str, Any] = {
        "x-queue-type": "quorum" if quorum else "classic",
        "x-dead-letter-exchange": dead_letter_name(name),
        "x-dead-letter-routing-key": dead_letter_name(name),
    }
    if max_priority is not None:
        arguments["x-max-priority"] = max_priority
    if delivery_limit is not None:
        arguments["x-delivery-limit"] = delivery_limit
    return Queue(name, Exchange(name, type="direct"), routing_key=name, queue_arguments=arguments)


def celery_app(broker_url: str, queues: list, *, accept_pickle: bool = False):
    from celery import Celery

    app = Celery("producer", broker=broker_url, backend=RESULTS_REDIS)
    app.conf.task_queues = queues
    app.conf.accept_content = ["json", "pickle"] if accept_pickle else ["json"]
    app.conf.result_accept_content = ["json"]
    app.conf.broker_connection_retry_on_startup = True
    return app


def amqp_url(port: int, queue: str, **params: object) -> str:
    extra = "".join(f"&{k}={v}" for k, v in params.items())
    return f"celery+amqp://guest:guest@127.0.0.1:{port}/?queue={queue}{extra}"


def queue_counts(port: int, queue: str) -> int:
    """Ready messages (a passive declare)."""
    import amqp

    connection = amqp.Connection(f"127.0.0.1:{port}")
    connection.connect()
    try:
        return int(connection.channel().queue_declare(queue, passive=True).message_count)
    finally:
        connection.close()


def publish_raw(port: int, queue: str, messages: list[tuple[bytes, dict[str, Any]]]) -> None:
    """Publish (body, properties) pairs as they are, to the queue's exchange."""
    import amqp

    connection = amqp.Connection(f"127.0.0.1:{port}")
    connection.connect()
    try:
        channel = connection.channel()
        for body, properties in messages:
            channel.basic_publish_confirm(amqp.Message(body, **properties), exchange=queue, routing_key=queue)
    finally:
        connection.close()


def celery_headers(task_id: str, task: str = TASK) -> dict[str, Any]:
    return {"lang": "py", "task": task, "id": task_id, "root_id": task_id, "retries": 0}


def forget(r: redis_lib.Redis, task_ids) -> None:
    for task_id in task_ids:
        r.delete(f"celery-task-meta-{task_id}", f"qworker:deltas:{task_id}")
