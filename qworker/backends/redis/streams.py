"""Job source on a Redis Stream with a consumer group, and its priority lane.

Two streams share the group: the priority lane `{stream}:high` and `{stream}` itself. A producer
with `high_lane_max_priority=N` in its URL writes jobs of priority N or lower (more urgent) to the
lane; a worker always reads the lane first, so an urgent job is leased at the worker's next free
slot however deep the stream is (docs/queues.md, "Priority").

- lease: XAUTOCLAIM of entries whose lease expired (their consumer died), lane first, then
  XREADGROUP of the lane and then the stream for what is left, in one script call.
- extend: XCLAIM ... JUSTID resets an entry's idle time without counting a delivery.
- ack: XACK + XDEL in one transaction, after the result is stored.
- release: set the entry's idle time past the lease, so the next XAUTOCLAIM of any peer takes it.
- dead_letter: XADD the entry with its reason to the dead-letter stream, then ack it.

A Redis that restarted without persistence has lost the stream and its group (NOGROUP): the
group is made again, leases held on the old stream are reported lost, and acks of entries that
no longer exist are done.
"""

from __future__ import annotations

import time
from typing import Any

from qworker.backends.redis import keys
from qworker.backends.redis.connection import (
    NO_WAIT,
    Durability,
    durability,
    parse_redis_url,
    worker_client,
)
from qworker.backends.redis.queue_streams import ensure_group, is_no_group, queue_streams
from qworker.backends.source import JobSource, Lease
from qworker.backends.urls import url_number
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

# New entries, the most urgent lane first, up to a total count, in one round trip.
# KEYS: the lanes in reading order; ARGV: group, consumer, count.
# Returns {lane index (1-based), entry id, {field, value, ...}} per entry.
_READ_LANES_LUA = """
local out = {}
local left = tonumber(ARGV[3])
for i, key in ipairs(KEYS) do
  if left <= 0 then break end
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', key, '>')
  if reply then
    for _, entry in ipairs(reply[1][2]) do
      table.insert(out, {i, entry[1], entry[2]})
    end
    left = left - #reply[1][2]
  end
end
return out
"""

# Dead-letter entries are kept for inspection, up to about this many.
DEAD_LETTER_MAXLEN = 100_000
# A released entry looks idle for this long: well past any lease, so the next reclaim takes it.
RELEASED_IDLE_MS = 10 * 365 * 24 * 3600 * 1000


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
    ) -> None:
        self.redis = redis
        self.durable = durable
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_letter_stream = dead_letter_stream or keys.dead_letter_stream(stream)
        self.lease_timeout_s = lease_timeout_s
        self.reclaim_interval_s = reclaim_interval_s
        self.high_stream = keys.high_lane_stream(stream)
        # Reading order: the priority lane first.
        self.lanes = (self.high_stream, stream)
        self.queue_name = f"redis-stream:{stream}"
        self._claim_owned = redis.register_script(_CLAIM_OWNED_LUA)
        self._read_lanes = redis.register_script(_READ_LANES_LUA)
        self._reclaim_cursors = dict.fromkeys(self.lanes, "0-0")
        self._last_reclaim = 0.0
        self._ensure_groups()

    def _ensure_groups(self) -> None:
        for lane in self.lanes:
            ensure_group(self.redis, lane, self.group)

    def _message_id(self, lane: str, entry_id: Any) -> str:
        entry = as_text(entry_id)  # the server made it: ASCII "<ms>-<seq>"
        return keys.HIGH_LANE_PREFIX + entry if lane == self.high_stream else entry

    def _lane_of(self, message_id: str) -> tuple[str, str]:
        """(stream, entry id) of a lease's message id."""
        if message_id.startswith(keys.HIGH_LANE_PREFIX):
            return self.high_stream, message_id[len(keys.HIGH_LANE_PREFIX) :]
        return self.stream, message_id

    def _by_lane(self, leases: list[Lease]) -> dict[str, dict[str, Lease]]:
        """{stream: {entry id: lease}} of the leases."""
        grouped: dict[str, dict[str, Lease]] = {}
        for lease in leases:
            lane, entry_id = self._lane_of(lease.message_id)
            grouped.setdefault(lane, {})[entry_id] = lease
        return grouped

    # -- lease -------------------------------------------------------------------------------

    def lease(self, max_count: int, block_s: float, *, is_idle: bool = True) -> list[Lease]:
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
        try:
            leases = self._read_ready(count)
            if leases or block_s <= 0:
                return leases
            # Nothing ready: wait on both streams at once. One entry per stream, so that at most
            # one more than asked comes back when both get one in the same instant; the rest of
            # the count is read at once after the wake-up.
            reply = self.redis.xreadgroup(
                self.group, self.consumer, dict.fromkeys(self.lanes, ">"), count=1, block=int(block_s * 1000)
            )
        except Exception as exc:
            if not is_no_group(exc):
                raise
            self._ensure_groups()
            return []
        by_lane = {as_text(stream): entries for stream, entries in reply or []}
        leases = [
            self._make_lease(lane, entry_id, fields, delivery_count=1)
            for lane in self.lanes
            for entry_id, fields in by_lane.get(lane, [])
        ]
        if leases and len(leases) < count:
            leases += self._read_new(count - len(leases), 0.0)
        return leases

    def _read_ready(self, count: int) -> list[Lease]:
        """Entries ready now, the lane's first, up to `count`, in one round trip."""
        reply = self._read_lanes(keys=list(self.lanes), args=[self.group, self.consumer, count])
        leases = []
        for lane_index, entry_id, flat_fields in reply or []:
            fields = dict(zip(flat_fields[::2], flat_fields[1::2], strict=True))
            leases.append(self._make_lease(self.lanes[int(lane_index) - 1], entry_id, fields, 1))
        return leases

    def _reclaim(self, count: int) -> list[Lease]:
        self._last_reclaim = time.monotonic()
        leases: list[Lease] = []
        for lane in self.lanes:
            if len(leases) < count:
                leases += self._reclaim_lane(lane, count - len(leases))
        return leases

    def _reclaim_lane(self, lane: str, count: int) -> list[Lease]:
        min_idle_ms = int(self.lease_timeout_s * 1000)
        try:
            cursor = self._reclaim_cursors[lane]
            reply = self.redis.xautoclaim(
                lane, self.group, self.consumer, min_idle_ms, start_id=cursor, count=count
            )
        except Exception as exc:
            if not is_no_group(exc):
                raise
            self._ensure_groups()
            self._reclaim_cursors = dict.fromkeys(self.lanes, "0-0")
            return []
        cursor, entries = reply[0], reply[1]
        self._reclaim_cursors[lane] = as_text(cursor)
        entries = [(entry_id, fields) for entry_id, fields in entries if fields is not None]
        if not entries:
            return []
        # XAUTOCLAIM does not return delivery counts; XPENDING does (one round trip for all).
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, _ in entries:
            pipe.xpending_range(lane, self.group, min=entry_id, max=entry_id, count=1)
        counts = []
        for info in pipe.execute():
            counts.append(int(info[0]["times_delivered"]) if info else 1)
        return [
            self._make_lease(lane, entry_id, fields, count)
            for (entry_id, fields), count in zip(entries, counts, strict=True)
        ]

    def _make_lease(self, lane: str, entry_id: Any, fields: dict[Any, Any], delivery_count: int) -> Lease:
        """The lease of one entry, whatever its fields hold: this never raises. An entry whose id
        field cannot name a result is leased with a `rejection` (the worker dead-letters it);
        any other oddity (no body, a body that is not a job) is the worker's to judge."""
        message_id = self._message_id(lane, entry_id)
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
        lost: list[Lease] = []
        for lane, held in self._by_lane(leases).items():
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
        lane, entry_id = self._lane_of(lease.message_id)
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
        for lane, held in self._by_lane(leases).items():
            try:
                self._claim_owned(keys=[lane], args=[self.group, self.consumer, RELEASED_IDLE_MS, *held])
            except Exception as exc:
                if not is_no_group(exc):
                    raise

    def dead_letter(self, lease: Lease, reason: str) -> None:
        lane, entry_id = self._lane_of(lease.message_id)
        pipe = self.redis.pipeline(transaction=True)
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
        pipe.xadd(self.dead_letter_stream, entry, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        pipe.xack(lane, self.group, entry_id)
        pipe.xdel(lane, entry_id)
        pipe.execute()
        self.durable.wait(self.redis)

    # -- stats -------------------------------------------------------------------------------

    def num_pending(self) -> int | None:
        pipe = self.redis.pipeline(transaction=False)
        for lane in self.lanes:
            pipe.xpending(lane, self.group)
        total = 0
        for summary in pipe.execute():
            for consumer in summary.get("consumers") or []:
                if as_text(consumer["name"]) == self.consumer:
                    total += int(consumer["pending"])
        return total

    def close(self) -> None:
        self.redis.close()


def _field(fields: dict[Any, Any], name: str) -> Any:
    """A field of an entry by name: redis-py gives bytes names (str with decode_responses)."""
    value = fields.get(name.encode())
    return value if value is not None else fields.get(name)


def open_source(url: str, consumer: str, lease_timeout_s: float | None) -> RedisStreamSource:
    parsed = parse_redis_url(url)
    redis = worker_client(parsed.connection_url)
    stream, dead = queue_streams(url, parsed, redis)
    return RedisStreamSource(
        redis,
        stream=stream,
        group=parsed.params.get("group", keys.DEFAULT_GROUP),
        consumer=consumer,
        dead_letter_stream=dead,
        lease_timeout_s=lease_timeout_s or url_number(parsed.params, "lease_timeout_s", 30.0),
        durable=durability(parsed),
    )
