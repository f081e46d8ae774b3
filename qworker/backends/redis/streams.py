"""Job source on a Redis Stream with a consumer group: its priority lane and its affinity lanes.

The streams of one queue share the group (lanes.py): the priority lane `{stream}:high`, the stream
itself, and with `affinity_lanes=L` (L > 1) the lanes `{stream}:lane:<i>`. A worker reads them in
its reading order (lanes.py, lane_reads.py): an urgent job is leased at the worker's next free slot
however deep the rest are (docs/queues.md, "Priority"), and a job with an affinity key goes to the
worker that owns its lane unless it has waited `steal_after_s` and another worker has room.

- lease: expired leases first (XPENDING ... IDLE, then XCLAIM: their consumer died), then new
  entries in the reading order, in one script call on one server.
- extend: XCLAIM ... JUSTID resets an entry's idle time without counting a delivery.
- ack: XACK + XDEL in one transaction, after the result is stored.
- release: set the entry's idle time past the lease, so the next reclaim of any peer takes it.
- dead_letter: XADD the entry with its reason to the dead-letter stream, then ack it.
- heartbeat (with lanes): the worker's score in `{stream}:workers`, the live set that lane
  ownership is computed over; a worker is live while its heartbeat is younger than its lease.

A Redis that restarted without persistence has lost the streams and their group (NOGROUP): the
group is made again, leases held on the old streams are reported lost, and acks of entries that
no longer exist are done.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from qworker.backends.redis import keys
from qworker.backends.redis.connection import (
    NO_WAIT,
    Durability,
    durability,
    key_layout,
    parse_redis_url,
    worker_client,
)
from qworker.backends.redis.lane_reads import (
    Entry,
    ExpiredScanner,
    PipelinedLaneReader,
    ScriptLaneReader,
    expired_leases,
)
from qworker.backends.redis.lanes import QueueStreams, ReadingOrder, reading_order
from qworker.backends.redis.queue_streams import ensure_groups, is_no_group, queue_lanes, queue_streams
from qworker.backends.source import JobSource, Lease
from qworker.backends.urls import InvalidURLError, redact_url, url_number
from qworker.jobs.job import job_id_problem
from qworker.utils import as_text

# Extend or release only the entries this consumer still owns: after a stall past the lease,
# a peer may have claimed one, and a blind XCLAIM would steal it back.
# KEYS[1] stream; ARGV: group, consumer, idle_ms, ids... Returns the ids we no longer own.
_CLAIM_OWNED_LUA = """
local lost = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if entry[1] ~= nil and entry[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', ARGV[3], 'JUSTID')
  else
    table.insert(lost, id)
  end
end
return lost
"""

# The worker's heartbeat, on the server's clock. KEYS[1]: the workers' sorted set; ARGV: worker,
# live_ms. Drops workers silent for ten times that; returns the live ones.
_HEARTBEAT_LUA = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local live_ms = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms - 10 * live_ms)
return redis.call('ZRANGEBYSCORE', KEYS[1], ms - live_ms, '+inf')
"""

# Dead-letter entries are kept for inspection, up to about this many.
DEAD_LETTER_MAXLEN = 100_000
# A released entry looks idle for this long: well past any lease, so the next reclaim takes it.
RELEASED_IDLE_MS = 10 * 365 * 24 * 3600 * 1000
# An entry of another worker's lane is taken once it has waited this long (seconds).
DEFAULT_STEAL_AFTER_S = 0.5
# On a cluster a blocking read cannot span the lanes' slots: it waits on the priority lane and
# the stream only, this long at most, and then reads the lanes again.
CLUSTER_BLOCK_S = 0.25


class RedisStreamSource(JobSource):
    def __init__(
        self,
        redis: Any,
        *,
        stream: str = keys.DEFAULT_STREAM,
        group: str = keys.DEFAULT_GROUP,
        consumer: str,
        dead_letter_stream: str | None = None,
        lease_timeout_s: float = 30.0,
        reclaim_interval_s: float = 1.0,
        durable: Durability = NO_WAIT,
        streams: QueueStreams | None = None,
        steal_after_s: float = DEFAULT_STEAL_AFTER_S,
        cluster: bool = False,
    ) -> None:
        self.redis = redis
        self.durable = durable
        self.streams = streams or QueueStreams.of(stream, 1, cluster=cluster)
        self.stream = self.streams.stream
        self.group = group
        self.consumer = consumer
        self.dead_letter_stream = dead_letter_stream or keys.dead_letter_stream(self.stream)
        self.lease_timeout_s = lease_timeout_s
        self.reclaim_interval_s = reclaim_interval_s
        self.steal_after_s = steal_after_s
        self.cluster = cluster
        self.high_stream = self.streams.high
        self.queue_name = f"redis-stream:{self.stream}"
        self._claim_owned = redis.register_script(_CLAIM_OWNED_LUA)
        self._heartbeat = redis.register_script(_HEARTBEAT_LUA)
        self._reader = (PipelinedLaneReader if cluster else ScriptLaneReader)(redis, group, consumer)
        self._expired = ExpiredScanner(redis, cluster=cluster)
        self._last_reclaim = 0.0
        # Lane ownership: the live workers at the last heartbeat, and this worker's order.
        self._live: frozenset[str] = frozenset({consumer})
        self._last_heartbeat = float("-inf")
        self._orders: dict[frozenset[str], list[ReadingOrder]] = {}
        self._rotation = 0
        self._ensure_groups()

    def _ensure_groups(self) -> None:
        ensure_groups(self.redis, self.streams.all, self.group)

    def _by_stream(self, leases: list[Lease]) -> dict[str, dict[str, Lease]]:
        """{stream: {entry id: lease}} of the leases."""
        grouped: dict[str, dict[str, Lease]] = {}
        for lease in leases:
            stream, entry_id = self.streams.locate(lease.message_id)
            grouped.setdefault(stream, {})[entry_id] = lease
        return grouped

    # -- lane ownership ----------------------------------------------------------------------

    def live_workers(self) -> frozenset[str]:
        """The workers reading the queue at the last heartbeat (this one included)."""
        return self._live

    def _beat(self) -> None:
        """Refresh this worker's heartbeat and the live set, at most three times a lease."""
        if not self.streams.lanes:
            return
        now = time.monotonic()
        if now - self._last_heartbeat < self.lease_timeout_s / 3:
            return
        self._last_heartbeat = now
        live_ms = int(self.lease_timeout_s * 1000)
        workers = self._heartbeat(keys=[keys.lane_workers_key(self.stream)], args=[self.consumer, live_ms])
        self._live = frozenset({self.consumer, *(as_text(w) for w in workers)})

    def reading_order(self) -> ReadingOrder:
        """This worker's reading order now: its own lanes turned by one at each call."""
        orders = self._orders.get(self._live)
        if orders is None:
            self._orders = {}  # the live set changed: the old orders are stale
            first = reading_order(self.streams, self.consumer, self._live, 0)
            orders = [
                ReadingOrder(first.urgent, first.fair[turn:] + first.fair[:turn], first.stealable)
                for turn in range(len(first.fair))
            ]
            self._orders[self._live] = orders
        self._rotation += 1
        return orders[self._rotation % len(orders)]

    # -- lease -------------------------------------------------------------------------------

    def lease(self, max_count: int, block_s: float, *, is_idle: bool = True) -> list[Lease]:
        self._beat()
        if max_count <= 0:
            return []
        leases: list[Lease] = []
        is_reclaimed = time.monotonic() - self._last_reclaim >= self.reclaim_interval_s
        if is_reclaimed:
            leases += self._reclaim(max_count)
        if len(leases) < max_count:
            leases += self._read_new(max_count - len(leases), block_s if not leases else 0.0)
        if not leases and not is_reclaimed and is_idle:
            # Nothing new: an idle (or burst) worker looks for expired leases now rather than at
            # the next interval, so that it never overlooks a dead peer's jobs. A busy worker
            # leaves it to the timer: each Redis round trip costs it ~2.5 ms per engine step.
            leases += self._reclaim(max_count)
        return leases

    def _read_new(self, count: int, block_s: float) -> list[Lease]:
        order = self.reading_order()
        steal_after_ms = int(self.steal_after_s * 1000)
        try:
            leases = [self._lease_of(e, 1) for e in self._reader.read(order, count, steal_after_ms)]
            if leases or block_s <= 0:
                return leases
            # Nothing ready: wait on the urgent and fair streams at once (on a cluster, those in
            # the stream's slot), one entry each, so that at most a few more than asked come back
            # when several get one in the same instant; the rest of the count is read at once
            # after the wake-up. With lanes to steal from, the wait ends in time to steal.
            waited = (self.high_stream, self.stream) if self.cluster else (order.urgent, *order.fair)
            if order.stealable:
                block_s = min(block_s, self.steal_after_s)
            if self.cluster and self.streams.lanes:
                block_s = min(block_s, CLUSTER_BLOCK_S)
            reply = self.redis.xreadgroup(
                self.group,
                self.consumer,
                dict.fromkeys(waited, ">"),
                count=1,
                block=max(1, int(block_s * 1000)),
            )
        except Exception as exc:
            if not is_no_group(exc):
                raise
            self._ensure_groups()
            return []
        by_stream = {as_text(stream): entries for stream, entries in reply or []}
        leases = [
            self._lease_of(Entry(stream, as_text(entry_id), fields), 1)
            for stream in waited
            for entry_id, fields in by_stream.get(stream, [])
        ]
        if len(leases) < count:
            leases += self._read_new(count - len(leases), 0.0)
        return leases

    def _reclaim(self, count: int) -> list[Lease]:
        self._last_reclaim = time.monotonic()
        min_idle_ms = int(self.lease_timeout_s * 1000)
        claimed = expired_leases(
            self.redis, self._expired, self.streams.all, self.group, self.consumer, count, min_idle_ms
        )
        return [self._lease_of(entry, delivered) for entry, delivered in claimed]

    def _lease_of(self, entry: Entry, delivery_count: int) -> Lease:
        return self._make_lease(entry.stream, entry.entry_id, entry.fields, delivery_count)

    def _make_lease(self, lane: str, entry_id: Any, fields: dict[Any, Any], delivery_count: int) -> Lease:
        """The lease of one entry, whatever its fields hold: this never raises. An entry whose id
        field cannot name a result is leased with a `rejection` (the worker dead-letters it);
        any other oddity (no body, a body that is not a job) is the worker's to judge."""
        message_id = self.streams.message_id(lane, as_text(entry_id))
        body = _field(fields, keys.FIELD_BODY)
        raw_job_id = _field(fields, keys.FIELD_JOB_ID)
        job_id: str | None = None
        rejection: str | None = None
        if raw_job_id:
            try:
                job_id = raw_job_id.decode() if isinstance(raw_job_id, bytes) else str(raw_job_id)
            except UnicodeDecodeError:
                rejection = f"the entry's {keys.FIELD_JOB_ID!r} field is not UTF-8 text"
            if job_id is not None:
                rejection = job_id_problem(job_id)
                if rejection is not None:
                    job_id = None
        if body is None and job_id is None and rejection is None:
            names = sorted(
                (name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else str(name))[:50]
                for name in fields
            )[:10]
            rejection = (
                f"the entry has neither a {keys.FIELD_BODY!r} nor an {keys.FIELD_JOB_ID!r} field "
                f"(its fields: {', '.join(repr(n) for n in names) or 'none'})"
            )
        # Entry ids start with the server's clock in milliseconds when the entry was added.
        enqueued_at = int(as_text(entry_id).split("-")[0]) / 1000.0
        return Lease(
            message_id=message_id,
            body=body if isinstance(body, bytes) else str(body or "").encode("utf-8", "backslashreplace"),
            job_id=job_id,
            delivery_count=delivery_count,
            enqueued_at=enqueued_at,
            rejection=rejection,
        )

    # -- holding and letting go --------------------------------------------------------------

    def extend(self, leases: list[Lease]) -> list[Lease]:
        # A busy worker (no room, so no lease calls) still beats here: it keeps its lanes.
        self._beat()
        lost: list[Lease] = []
        for lane, held in self._by_stream(leases).items():
            try:
                lost_ids = self._claim_owned(keys=[lane], args=[self.group, self.consumer, 0, *held])
            except Exception as exc:
                if not is_no_group(exc):
                    raise
                # The stream is gone (a restart without persistence): so is every lease on it.
                self._ensure_groups()
                lost += held.values()
                continue
            lost += [held[as_text(x)] for x in lost_ids]
        return lost

    def ack(self, lease: Lease) -> None:
        lane, entry_id = self.streams.locate(lease.message_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(lane, self.group, entry_id)
        # Acked entries are deleted so that the stream does not grow without bound. (A second
        # consumer group on the same stream would need them kept; qworker uses one group.)
        pipe.xdel(lane, entry_id)
        try:
            pipe.execute()
        except Exception as exc:
            if not is_no_group(exc):
                raise  # with no group, the entry is gone: nothing left to ack

    def release(self, leases: list[Lease]) -> None:
        for lane, held in self._by_stream(leases).items():
            try:
                self._claim_owned(keys=[lane], args=[self.group, self.consumer, RELEASED_IDLE_MS, *held])
            except Exception as exc:
                if not is_no_group(exc):
                    raise

    def dead_letter(self, lease: Lease, reason: str) -> None:
        lane, entry_id = self.streams.locate(lease.message_id)
        entry = {
            "source_stream": lane,
            "message_id": entry_id,
            # The reason may quote the input, which may not be valid Unicode.
            "reason": reason.encode("utf-8", "backslashreplace"),
            "delivery_count": lease.delivery_count,
            keys.FIELD_BODY: lease.body,
        }
        if lease.job_id is not None:
            entry[keys.FIELD_JOB_ID] = lease.job_id
        # On a cluster an affinity lane sits in another slot than the dead letters, so the letter
        # is written first and the entry acked after: a crash in between leaves the entry to be
        # leased again and dead-lettered a second time, never lost.
        in_one_slot = not (self.cluster and lane in self.streams.lanes)
        pipe = self.redis.pipeline(transaction=in_one_slot)
        pipe.xadd(self.dead_letter_stream, entry, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        if not in_one_slot:
            pipe.execute()
            pipe = self.redis.pipeline(transaction=True)
        pipe.xack(lane, self.group, entry_id)
        pipe.xdel(lane, entry_id)
        pipe.execute()
        self.durable.wait(self.redis)

    # -- stats -------------------------------------------------------------------------------

    def num_pending(self) -> int | None:
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams.all:
            pipe.xpending(stream, self.group)
        total = 0
        for summary in pipe.execute():
            for consumer in summary.get("consumers") or []:
                if as_text(consumer["name"]) == self.consumer:
                    total += int(consumer["pending"])
        return total

    def close(self) -> None:
        if self.streams.lanes:
            # Leaving at once hands this worker's lanes to the others now, not after its lease.
            with contextlib.suppress(Exception):  # closing: the heartbeat expires anyway
                self.redis.zrem(keys.lane_workers_key(self.stream), self.consumer)
        self.redis.close()


def _field(fields: dict[Any, Any], name: str) -> Any:
    """A field of an entry by name: redis-py gives bytes names (str with decode_responses)."""
    value = fields.get(name.encode())
    return value if value is not None else fields.get(name)


def open_source(url: str, consumer: str, lease_timeout_s: float | None) -> RedisStreamSource:
    parsed = parse_redis_url(url)
    redis = worker_client(parsed.connection_url)
    stream, dead = queue_streams(url, parsed, redis)
    steal_after_s = url_number(parsed.params, "steal_after_s", DEFAULT_STEAL_AFTER_S)
    if steal_after_s < 0:
        raise InvalidURLError(f"steal_after_s must be >= 0, got {steal_after_s} (in {redact_url(url)!r})")
    return RedisStreamSource(
        redis,
        group=parsed.params.get("group", keys.DEFAULT_GROUP),
        consumer=consumer,
        dead_letter_stream=dead,
        lease_timeout_s=lease_timeout_s or url_number(parsed.params, "lease_timeout_s", 30.0),
        durable=durability(parsed),
        streams=queue_lanes(url, parsed, redis, stream),
        steal_after_s=steal_after_s,
        cluster=key_layout(url).hash_tags,
    )
