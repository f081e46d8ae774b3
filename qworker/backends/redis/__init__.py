"""Redis: a job queue on a Redis Stream with a priority lane (streams.py, producer.py), a result
store (results.py), the backlog reader (backlog.py), the dead-letter stream (dead_letters.py) and
the workers' stats reports (reports.py). One redis:// URL may serve as queue and results at once.
Key layout: keys.py; a queue URL's streams and group: queue_streams.py; URLs and clients: connection.py;
the embedded server (embedded.py), a private redis-server (server.py) and the replica, sentinel and
cluster topologies tests and benchmarks start (topologies.py)."""

from __future__ import annotations

from qworker.backends import Backend
from qworker.backends.redis.backlog import open_backlog
from qworker.backends.redis.dead_letters import open_dead_letters
from qworker.backends.redis.producer import open_producer
from qworker.backends.redis.results import open_sink
from qworker.backends.redis.streams import open_source

BACKEND = Backend(
    name="redis",
    open_source=open_source,
    open_producer=open_producer,
    open_sink=open_sink,
    open_backlog=open_backlog,
    open_dead_letters=open_dead_letters,
)
