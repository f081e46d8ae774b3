"""Celery on RabbitMQ: Celery protocol v2 messages taken with basic.get and manual acks
(source.py), sent as `app.send_task` would (producer.py), the dead-letter exchange and queue
`{queue}.dead` (dead_letters.py), the queue depth (backlog.py). One connection and the queue
declarations: broker.py; URLs and the queue's arguments: url.py. Results go to Celery's Redis
result backend (`--results celery+redis://...`, ../celery/results.py): AMQP stores none."""

from __future__ import annotations

from qworker.backends import Backend, NotSupported, Requirement
from qworker.backends.celery_amqp.backlog import open_backlog
from qworker.backends.celery_amqp.dead_letters import open_dead_letters
from qworker.backends.celery_amqp.producer import open_producer
from qworker.backends.celery_amqp.source import open_source

BACKEND = Backend(
    name="celery+amqp",
    open_source=open_source,
    open_producer=open_producer,
    open_sink=NotSupported(
        "RabbitMQ stores no results; give --results celery+redis://host:port/db "
        "(Celery's Redis result backend)"
    ),
    open_backlog=open_backlog,
    open_dead_letters=open_dead_letters,
    requires=(Requirement("amqp", "celery"),),
)
