"""The backlog of a Redis Streams queue (the stream, its priority lane and its affinity lanes), in
jobs and KV blocks, summed over them all: see ../backlog.py for what each term means."""

from __future__ import annotations

from typing import Any

from qworker.backends.backlog import DEFAULT_SAMPLE_LIMIT, Backlog, QueueWork
from qworker.backends.redis import keys
from qworker.backends.redis.connection import parse_redis_url, redis_client
from qworker.backends.redis.lanes import QueueStreams
from qworker.backends.redis.queue_streams import queue_lanes, queue_streams
from qworker.backends.urls import url_number
from qworker.pool.demand import PoolSizing, Work, body_blocks, extrapolate
from qworker.utils import as_text


class RedisStreamBacklog:
    def __init__(
        self,
        redis: Any,
        sizing: PoolSizing,
        *,
        stream: str = keys.DEFAULT_STREAM,
        group: str = keys.DEFAULT_GROUP,
        lease_timeout_s: float = 30.0,
        sample_limit: int = DEFAULT_SAMPLE_LIMIT,
        streams: QueueStreams | None = None,
    ) -> None:
        self.redis = redis
        self.sizing = sizing
        self.streams = streams or QueueStreams.of(stream, 1, cluster=False)
        self.stream = self.streams.stream
        self.group = group
        self.lease_timeout_s = lease_timeout_s
        self.sample_limit = sample_limit

    def _group_info(self, stream: str) -> dict[str, Any] | None:
        import redis as redis_lib

        try:
            groups = self.redis.xinfo_groups(stream)
        except redis_lib.ResponseError:  # no such stream yet
            return None
        for group in groups:
            if as_text(group["name"]) == self.group:
                return group
        return None

    def _bodies_blocks(self, entries: list[tuple[Any, dict[Any, Any]]]) -> list[int]:
        field = keys.FIELD_BODY.encode()
        blocks = []
        for _, fields in entries:
            body = fields.get(field, fields.get(keys.FIELD_BODY))
            blocks.append(body_blocks(body, self.sizing) if body is not None else 1)
        return blocks

    def read(self, live_workers: set[str] | None) -> QueueWork:
        # The lengths in one round trip: most lanes are empty at any moment and cost nothing more.
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams.all:
            pipe.xlen(stream)
        sizes = [int(n) for n in pipe.execute()]
        waiting, in_flight = Work(), Work()
        for stream, num_entries in zip(self.streams.all, sizes, strict=True):
            if num_entries == 0:
                continue
            work = self.read_stream(stream, num_entries, live_workers)
            waiting, in_flight = waiting + work.waiting, in_flight + work.in_flight
        return QueueWork(waiting, in_flight)

    def read_stream(self, stream: str, num_entries: int, live_workers: set[str] | None) -> QueueWork:
        """One stream's part of read(), given its XLEN (the dashboard shows lanes one by one)."""
        group = self._group_info(stream)
        if group is None:
            # No worker ever joined (scale from zero): every entry waits.
            sample = self.redis.xrange(stream, "-", "+", count=self.sample_limit)
            return QueueWork(extrapolate(self._bodies_blocks(sample), num_entries, self.sizing), Work())
        num_pending = int(group["pending"])
        lag = group.get("lag")
        num_undelivered = int(lag) if lag is not None else max(0, num_entries - num_pending)
        last_id = as_text(group["last-delivered-id"])
        undelivered = self.redis.xrange(stream, f"({last_id}", "+", count=self.sample_limit)
        waiting = extrapolate(self._bodies_blocks(undelivered), num_undelivered, self.sizing)
        if num_pending == 0:
            return QueueWork(waiting, Work())

        pending = self.redis.xpending_range(stream, self.group, "-", "+", self.sample_limit)
        lease_ms = self.lease_timeout_s * 1000
        orphan_ids: list[Any] = []
        held_ids: list[Any] = []
        for entry in pending:
            is_orphan = entry["time_since_delivered"] >= lease_ms or (
                live_workers is not None and as_text(entry["consumer"]) not in live_workers
            )
            (orphan_ids if is_orphan else held_ids).append(entry["message_id"])
        pipe = self.redis.pipeline(transaction=False)
        for message_id in (*orphan_ids, *held_ids):
            pipe.xrange(stream, message_id, message_id)
        found = pipe.execute()
        # An entry acked (and deleted) since XPENDING: gone, not counted.
        orphan_entries = [e[0] for e in found[: len(orphan_ids)] if e]
        held_entries = [e[0] for e in found[len(orphan_ids) :] if e]
        num_sampled = len(orphan_ids) + len(held_ids)
        num_orphans = round(num_pending * len(orphan_ids) / num_sampled) if num_sampled else 0
        orphans = extrapolate(self._bodies_blocks(orphan_entries), num_orphans, self.sizing)
        in_flight = extrapolate(self._bodies_blocks(held_entries), num_pending - num_orphans, self.sizing)
        return QueueWork(waiting + orphans, in_flight)

    def close(self) -> None:
        self.redis.close()


def open_backlog(url: str, sizing: PoolSizing, lease_timeout_s: float | None) -> Backlog:
    # The same parsing as the source's: the same parameters, checked the same way.
    parsed = parse_redis_url(url)
    redis = redis_client(parsed.connection_url)
    stream = queue_streams(url, parsed, redis)[0]
    return RedisStreamBacklog(
        redis,
        sizing,
        group=parsed.params.get("group", keys.DEFAULT_GROUP),
        lease_timeout_s=lease_timeout_s or url_number(parsed.params, "lease_timeout_s", 30.0),
        streams=queue_lanes(url, parsed, redis, stream),
    )
