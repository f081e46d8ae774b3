"""Where the gateway keeps what must outlive a replica: file and batch objects, owners' listings,
job records, idempotency keys, leases and webhook attempts. All of it is in Redis, under
`{prefix}:gw:` of the result store (or of `--stream-results` when results are in S3), so that a
killed replica loses nothing and every replica sees the same state.

Key layout (prefix P = the result store's prefix + ":gw"):

    P:obj:{kind}:{id}           JSON of one object (file, batch, job), kept `ttl_s`
    P:list:{kind}:{owner}       sorted set of ids in creation order: what `GET /v1/{kind}s` pages
    P:order                     the counter that gives that order
    P:active:{kind}             set of ids a background service still has to drive
    P:idem:{owner}:{scope}:{key}   idempotency record (idempotency.py)
    P:lease:{kind}:{id}         lease token of the replica driving it (leases.py)
"""

from __future__ import annotations

import json
from typing import Any

from qworker.backends.sink import ResultSink
from qworker.gateway.errors import GatewayError

# Objects (and their listings) live as long as OpenAI keeps a batch's files by default.
DEFAULT_RECORD_TTL_S = 30 * 24 * 3600


class RecordsUnavailableError(GatewayError):
    def __init__(self) -> None:
        super().__init__(
            501,
            "files, batches and async jobs need a Redis result store (or --stream-results redis://...) "
            "for their state",
            code="not_supported",
        )


def redis_of(sink: ResultSink) -> tuple[Any, str] | None:
    """The Redis client and key prefix behind a result store, if it has one."""
    from qworker.backends.redis.results import RedisResultSink
    from qworker.backends.split_sink import SplitSink

    if isinstance(sink, SplitSink):
        return redis_of(sink.final) or redis_of(sink.stream)
    if isinstance(sink, RedisResultSink):
        return sink.redis, sink.prefix
    return None


class Records:
    """JSON objects by kind and id, with per-owner listings; every call is one round trip or two."""

    def __init__(self, redis: Any, prefix: str, ttl_s: int = DEFAULT_RECORD_TTL_S) -> None:
        self.redis = redis
        self.prefix = f"{prefix}:gw"
        self.ttl_s = ttl_s

    @classmethod
    def of_sink(cls, sink: ResultSink) -> Records | None:
        found = redis_of(sink)
        return cls(*found) if found is not None else None

    def key(self, *parts: str) -> str:
        return ":".join([self.prefix, *parts])

    def put(self, kind: str, object_id: str, data: dict[str, Any]) -> None:
        self.redis.set(self.key("obj", kind, object_id), json.dumps(data), ex=self.ttl_s)

    def get(self, kind: str, object_id: str) -> dict[str, Any] | None:
        raw = self.redis.get(self.key("obj", kind, object_id))
        return json.loads(raw) if raw is not None else None

    def delete(self, kind: str, object_id: str, owner: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.key("obj", kind, object_id))
        pipe.zrem(self.key("list", kind, owner), object_id)
        pipe.execute()

    def create(self, kind: str, object_id: str, owner: str, data: dict[str, Any]) -> None:
        """Store a new object and list it under its owner, after every object created before it."""
        # A counter, not the creation time: objects created in the same second keep their order.
        order = self.redis.incr(self.key("order"))
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.key("obj", kind, object_id), json.dumps(data), ex=self.ttl_s)
        listing = self.key("list", kind, owner)
        pipe.zadd(listing, {object_id: order})
        pipe.expire(listing, self.ttl_s)
        pipe.execute()

    def page(self, kind: str, owner: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        """Ids of the owner's objects, newest first, starting after the id `after`; and whether
        more follow. An `after` that is not the owner's starts from the newest."""
        listing = self.key("list", kind, owner)
        start = 0
        if after is not None:
            rank = self.redis.zrevrank(listing, after)
            if rank is not None:
                start = rank + 1
        ids = [raw.decode() for raw in self.redis.zrevrange(listing, start, start + limit)]
        return ids[:limit], len(ids) > limit

    def owner_ids(self, kind: str, owner: str) -> list[str]:
        return [raw.decode() for raw in self.redis.zrange(self.key("list", kind, owner), 0, -1)]

    def activate(self, kind: str, object_id: str) -> None:
        self.redis.sadd(self.key("active", kind), object_id)

    def deactivate(self, kind: str, object_id: str) -> None:
        self.redis.srem(self.key("active", kind), object_id)

    def active_ids(self, kind: str) -> list[str]:
        return sorted(raw.decode() for raw in self.redis.smembers(self.key("active", kind)))
