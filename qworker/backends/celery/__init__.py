"""Celery on Redis: Celery protocol v2 messages taken straight from the broker (source.py), sent as
`app.send_task` would (producer.py), results in Celery's Redis result-backend format
(results.py), the backlog reader (backlog.py) and the dead-letter list (dead_letters.py). Key
layout: keys.py; URLs: url.py."""

from __future__ import annotations

from qworker.backends import Backend, Requirement
from qworker.backends.celery.backlog import open_backlog
from qworker.backends.celery.dead_letters import open_dead_letters
from qworker.backends.celery.producer import open_producer
from qworker.backends.celery.results import open_sink
from qworker.backends.celery.source import open_source

BACKEND = Backend(
    name="celery",
    open_source=open_source,
    open_producer=open_producer,
    open_sink=open_sink,
    open_backlog=open_backlog,
    open_dead_letters=open_dead_letters,
    requires=(Requirement("kombu", "celery"),),
)
