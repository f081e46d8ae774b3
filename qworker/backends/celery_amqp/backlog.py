"""The backlog of a Celery queue on RabbitMQ (see ../backlog.py for what each term means).

AMQP cannot show a queued body without taking it, so every job counts the configured
`mean_job_tokens` (KV demand = depth x mean blocks per job), as on SQS. Waiting: the ready
messages (a passive queue.declare's message count). In flight: the unacked ones, which AMQP does
not report: read from the management API (`management_url`, GET /api/queues/{vhost}/{queue},
`messages_unacknowledged`) when the URL names it, else 0, and the exporter takes running work
from the workers' own reports (--stats), which know each held job's real size.
"""

from __future__ import annotations

import base64
import json
import urllib.parse
import urllib.request

from qworker.backends.backlog import Backlog, QueueWork
from qworker.backends.celery_amqp.broker import AmqpBroker
from qworker.backends.celery_amqp.url import AmqpQueue, parse_amqp_url
from qworker.pool.demand import PoolSizing, extrapolate


class AmqpBacklog:
    def __init__(self, config: AmqpQueue, sizing: PoolSizing) -> None:
        self.config = config
        self.sizing = sizing
        self.broker = AmqpBroker(config)

    def read(self, live_workers: set[str] | None) -> QueueWork:
        if self.config.management_url is not None:
            num_ready, num_unacked = self._management_counts()
        else:
            declared = self.broker.call(
                "reading depth", lambda ch: ch.queue_declare(self.config.queue, passive=True)
            )
            num_ready, num_unacked = int(declared.message_count), 0
        return QueueWork(extrapolate([], num_ready, self.sizing), extrapolate([], num_unacked, self.sizing))

    def _management_counts(self) -> tuple[int, int]:
        c = self.config
        assert c.management_url is not None
        vhost = urllib.parse.quote(c.virtual_host, safe="")
        request = urllib.request.Request(
            f"{c.management_url.rstrip('/')}/api/queues/{vhost}/{urllib.parse.quote(c.queue)}"
        )
        credentials = base64.b64encode(f"{c.userid}:{c.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {credentials}")
        with urllib.request.urlopen(request, timeout=5) as reply:
            queue = json.load(reply)
        return int(queue.get("messages_ready", 0)), int(queue.get("messages_unacknowledged", 0))

    def close(self) -> None:
        self.broker.close()


def open_backlog(url: str, sizing: PoolSizing, lease_timeout_s: float | None) -> Backlog:
    return AmqpBacklog(parse_amqp_url(url), sizing)
