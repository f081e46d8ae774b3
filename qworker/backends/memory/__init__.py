"""This process's memory (kombu's `memory` transport, with leases): a job queue (queue.py) and a
result store (results.py), for unit tests of the worker loop and for trying qworker without a
server. Nothing outlives the process, so there is no backlog for a pool to scale on and no
dead-letter queue for an operator to inspect from another process."""

from __future__ import annotations

from qworker.backends import Backend, NotSupported
from qworker.backends.memory.queue import open_producer, open_source
from qworker.backends.memory.results import open_sink

BACKEND = Backend(
    name="memory",
    open_source=open_source,
    open_producer=open_producer,
    open_sink=open_sink,
    open_backlog=NotSupported(
        "an in-memory queue lives in one process; no exporter or pool beside it can read its backlog"
    ),
    open_dead_letters=NotSupported(
        "an in-memory queue's dead letters live in its process (MemoryQueue.dead_letters), out of "
        "reach of the `qworker dlq` command"
    ),
)
