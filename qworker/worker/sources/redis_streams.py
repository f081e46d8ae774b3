"""Job source on a Redis Stream with a consumer group.

- lease: XAUTOCLAIM of entries whose lease expired (their consumer died), then XREADGROUP.
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

from qworker.worker import constants
from qworker.worker.connections import SINK_PARAMS, SOURCE_PARAMS, parse_redis_url, redis_client, url_number
from qworker.worker.jobs import job_id_problem
from qworker.worker.retry import bound_socket_timeouts
from qworker.worker.sources.base import JobProducer, JobSource, Lease, OutgoingJob
from qworker.worker.text import as_text

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

# Dead-letter entries are kept for inspection, up to about this many.
DEAD_LETTER_MAXLEN = 100_000
# A released entry looks idle for this long: well past any lease, so the next reclaim takes it.
RELEASED_IDLE_MS = 10 * 365 * 24 * 3600 * 1000


class RedisStreamSource(JobSource):
    def __init__(
        self,
        redis: Any,
        *,
        stream: str = constants.DEFAULT_STREAM,
        group: str = constants.DEFAULT_GROUP,
        consumer: str,
        dead_letter_stream: str | None = None,
        lease_timeout_s: float = 30.0,
        reclaim_interval_s: float = 1.0,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_letter_stream = dead_letter_stream or constants.dead_letter_stream(stream)
        self.lease_timeout_s = lease_timeout_s
        self.reclaim_interval_s = reclaim_interval_s
        self.queue_name = f"redis-stream:{stream}"
        self._claim_owned = redis.register_script(_CLAIM_OWNED_LUA)
        self._reclaim_cursor = "0-0"
        self._last_reclaim = 0.0
        ensure_group(redis, stream, group)

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
        block_ms = int(block_s * 1000) if block_s > 0 else None
        try:
            reply = self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
            )
        except Exception as exc:
            if not _is_no_group(exc):
                raise
            ensure_group(self.redis, self.stream, self.group)
            return []
        leases = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                leases.append(self._make_lease(entry_id, fields, delivery_count=1))
        return leases

    def _reclaim(self, count: int) -> list[Lease]:
        self._last_reclaim = time.monotonic()
        min_idle_ms = int(self.lease_timeout_s * 1000)
        try:
            cursor = self._reclaim_cursor
            reply = self.redis.xautoclaim(
                self.stream, self.group, self.consumer, min_idle_ms, start_id=cursor, count=count
            )
        except Exception as exc:
            if not _is_no_group(exc):
                raise
            ensure_group(self.redis, self.stream, self.group)
            self._reclaim_cursor = "0-0"
            return []
        cursor, entries = reply[0], reply[1]
        self._reclaim_cursor = as_text(cursor)
        entries = [(entry_id, fields) for entry_id, fields in entries if fields is not None]
        if not entries:
            return []
        # XAUTOCLAIM does not return delivery counts; XPENDING does (one round trip for all).
        pipe = self.redis.pipeline(transaction=False)
        for entry_id, _ in entries:
            pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        counts = []
        for info in pipe.execute():
            counts.append(int(info[0]["times_delivered"]) if info else 1)
        return [
            self._make_lease(entry_id, fields, count)
            for (entry_id, fields), count in zip(entries, counts, strict=True)
        ]

    def _make_lease(self, entry_id: Any, fields: dict[Any, Any], delivery_count: int) -> Lease:
        """The lease of one entry, whatever its fields hold: this never raises. An entry whose id
        field cannot name a result is leased with a `rejection` (the worker dead-letters it);
        any other oddity (no body, a body that is not a job) is the worker's to judge."""
        message_id = as_text(entry_id)  # the server made it: ASCII "<ms>-<seq>"
        body = _field(fields, constants.FIELD_BODY)
        raw_job_id = _field(fields, constants.FIELD_JOB_ID)
        job_id: str | None = None
        rejection: str | None = None
        if raw_job_id:
            try:
                job_id = raw_job_id.decode() if isinstance(raw_job_id, bytes) else str(raw_job_id)
            except UnicodeDecodeError:
                rejection = f"the entry's {constants.FIELD_JOB_ID!r} field is not UTF-8 text"
            if job_id is not None:
                rejection = job_id_problem(job_id)
                if rejection is not None:
                    job_id = None
        # Entry ids start with the server's clock in milliseconds when the entry was added.
        enqueued_at = int(message_id.split("-")[0]) / 1000.0
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
        if not leases:
            return []
        try:
            lost = self._claim_owned(
                keys=[self.stream], args=[self.group, self.consumer, 0, *[le.message_id for le in leases]]
            )
        except Exception as exc:
            if not _is_no_group(exc):
                raise
            # The stream is gone (a restart without persistence): so is every lease on it.
            ensure_group(self.redis, self.stream, self.group)
            return list(leases)
        lost_ids = {as_text(x) for x in lost}
        return [le for le in leases if le.message_id in lost_ids]

    def ack(self, lease: Lease) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, lease.message_id)
        # Acked entries are deleted so that the stream does not grow without bound. (A second
        # consumer group on the same stream would need them kept; qworker uses one group.)
        pipe.xdel(self.stream, lease.message_id)
        try:
            pipe.execute()
        except Exception as exc:
            if not _is_no_group(exc):
                raise  # with no group, the entry is gone: nothing left to ack

    def release(self, leases: list[Lease]) -> None:
        if leases:
            try:
                self._claim_owned(
                    keys=[self.stream],
                    args=[self.group, self.consumer, RELEASED_IDLE_MS, *[le.message_id for le in leases]],
                )
            except Exception as exc:
                if not _is_no_group(exc):
                    raise

    def dead_letter(self, lease: Lease, reason: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        entry = {
            "source_stream": self.stream,
            "message_id": lease.message_id,
            # The reason may quote the input, which may not be valid Unicode.
            "reason": reason.encode("utf-8", "backslashreplace"),
            "delivery_count": lease.delivery_count,
            constants.FIELD_BODY: lease.body,
        }
        if lease.job_id is not None:
            entry[constants.FIELD_JOB_ID] = lease.job_id
        pipe.xadd(self.dead_letter_stream, entry, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        pipe.xack(self.stream, self.group, lease.message_id)
        pipe.xdel(self.stream, lease.message_id)
        pipe.execute()

    # -- stats -------------------------------------------------------------------------------

    def num_pending(self) -> int | None:
        summary = self.redis.xpending(self.stream, self.group)
        for consumer in summary.get("consumers") or []:
            if as_text(consumer["name"]) == self.consumer:
                return int(consumer["pending"])
        return 0

    def close(self) -> None:
        self.redis.close()


def _is_no_group(exc: Exception) -> bool:
    """The stream or its consumer group does not exist (Redis restarted without persistence)."""
    import redis as redis_lib

    return isinstance(exc, redis_lib.ResponseError) and "NOGROUP" in str(exc)


def ensure_group(redis: Any, stream: str, group: str) -> None:
    """Create the stream and its consumer group if missing (from the start of the stream)."""
    import redis as redis_lib

    try:
        redis.xgroup_create(stream, group, id="0", mkstream=True)
    except redis_lib.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class RedisStreamProducer(JobProducer):
    def __init__(
        self, redis: Any, *, stream: str = constants.DEFAULT_STREAM, group: str = constants.DEFAULT_GROUP
    ):
        self.redis = redis
        self.stream = stream
        self.group = group
        # The group exists before the first job, so that no job predates it unseen.
        ensure_group(redis, stream, group)

    def send(self, jobs: list[OutgoingJob]) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xadd(self.stream, {constants.FIELD_JOB_ID: job.job_id, constants.FIELD_BODY: job.body})
        return [as_text(x) for x in pipe.execute()]

    def queue_depth(self) -> int | None:
        return int(self.redis.xlen(self.stream))

    def close(self) -> None:
        self.redis.close()


def _field(fields: dict[Any, Any], name: str) -> Any:
    """A field of an entry by name: redis-py gives bytes names (str with decode_responses)."""
    value = fields.get(name.encode())
    return value if value is not None else fields.get(name)


# A Redis URL may serve as queue and results at once: the sink's parameters are accepted too.
URL_PARAMS = SOURCE_PARAMS | SINK_PARAMS


def open_source(url: str, consumer: str, lease_timeout_s: float | None) -> RedisStreamSource:
    parsed = parse_redis_url(url, URL_PARAMS)
    stream = parsed.params.get("stream", constants.DEFAULT_STREAM)
    return RedisStreamSource(
        bound_socket_timeouts(redis_client(parsed.connection_url)),
        stream=stream,
        group=parsed.params.get("group", constants.DEFAULT_GROUP),
        consumer=consumer,
        dead_letter_stream=parsed.params.get("dead_letter", constants.dead_letter_stream(stream)),
        lease_timeout_s=lease_timeout_s or url_number(parsed.params, "lease_timeout_s", 30.0),
    )


def open_producer(url: str, payload_location: str | None) -> RedisStreamProducer:
    parsed = parse_redis_url(url, URL_PARAMS)
    return RedisStreamProducer(
        redis_client(parsed.connection_url),
        stream=parsed.params.get("stream", constants.DEFAULT_STREAM),
        group=parsed.params.get("group", constants.DEFAULT_GROUP),
    )
