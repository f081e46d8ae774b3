"""The backlog of a Celery queue on Redis, in jobs and KV blocks: see ../backlog.py for what each
term means."""

from __future__ import annotations

import base64
import json
from typing import Any

from qworker.backends.backlog import DEFAULT_SAMPLE_LIMIT, Backlog, QueueWork
from qworker.backends.celery import keys
from qworker.backends.celery.url import parse_celery_redis_url
from qworker.backends.redis.connection import redis_client
from qworker.pool.demand import PoolSizing, body_blocks, extrapolate


def celery_envelope_blocks(raw: bytes | str, sizing: PoolSizing) -> int:
    """Blocks of the job in a kombu Redis envelope (JSON with a base64 Celery protocol v2 body)."""
    try:
        envelope = json.loads(raw)
        if isinstance(envelope, list):  # the unacked hash keeps [envelope, exchange, routing_key]
            envelope = envelope[0]
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, kwargs, _ = json.loads(body)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return 1
    if not args and isinstance(kwargs, dict):
        return body_blocks(json.dumps(kwargs), sizing)
    if isinstance(args, list) and len(args) == 1 and isinstance(args[0], dict):
        return body_blocks(json.dumps(args[0]), sizing)
    return 1


class CeleryBacklog:
    def __init__(
        self,
        redis: Any,
        sizing: PoolSizing,
        *,
        queue: str = keys.DEFAULT_QUEUE,
        sample_limit: int = DEFAULT_SAMPLE_LIMIT,
    ) -> None:
        self.redis = redis
        self.sizing = sizing
        self.queue = queue
        self.sample_limit = sample_limit

    def read(self, live_workers: set[str] | None) -> QueueWork:
        # kombu's Redis transport LPUSHes and pops from the right: the right end is the oldest.
        unacked_key = keys.unacked_key(self.queue)
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(self.queue)
        pipe.lrange(self.queue, -self.sample_limit, -1)
        pipe.hlen(unacked_key)
        pipe.hrandfield(unacked_key, self.sample_limit, withvalues=True)
        num_waiting, waiting_sample, num_in_flight, unacked_sample = pipe.execute()
        waiting = extrapolate(
            [celery_envelope_blocks(raw, self.sizing) for raw in waiting_sample],
            int(num_waiting),
            self.sizing,
        )
        # HRANDFIELD ... WITHVALUES: [field, value, field, value, ...]
        values = (unacked_sample or [])[1::2]
        in_flight = extrapolate(
            [celery_envelope_blocks(raw, self.sizing) for raw in values], int(num_in_flight), self.sizing
        )
        return QueueWork(waiting, in_flight)

    def close(self) -> None:
        self.redis.close()


def open_backlog(url: str, sizing: PoolSizing, lease_timeout_s: float | None) -> Backlog:
    redis_url, params = parse_celery_redis_url(url)
    return CeleryBacklog(redis_client(redis_url), sizing, queue=params.get("queue", keys.DEFAULT_QUEUE))
