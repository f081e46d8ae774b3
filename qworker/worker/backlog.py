"""What a queue holds, in jobs and KV blocks: the inputs of the pool-demand signal (demand.py).

Per queue, read without taking anything (no lease, no receive, no delivery counted):

- Redis Streams, the stream and its priority lane `{stream}:high` alike. Waiting: the entries
  not yet delivered to the group (its lag; XLEN minus pending where Redis does not know the lag,
  which is exact because qworker deletes what it acks), plus pending entries no live worker holds
  (their consumer has no stats report, or their idle time is past the lease: a dead worker's or a
  released one, which the next reclaim hands out again). Bodies are read with XRANGE, so text
  prompts are sized by length and token-id prompts exactly. In flight: the other pending
  entries, sized from their bodies too.
- Celery on Redis. Waiting: the queue list (LLEN; bodies from LRANGE, Celery protocol v2 envelopes).
  In flight: kombu's unacked hash of the queue (HLEN; bodies from HVALS).
- SQS. ApproximateNumberOfMessages (+ Delayed) waiting and ApproximateNumberOfMessagesNotVisible
  in flight. SQS cannot show a body without receiving it, and a receive counts as a delivery
  (ApproximateReceiveCount, which dead-letters a job after max_attempts), so each message counts
  `mean_job_tokens`: configured, or the mean the live workers report.

Running demand prefers the workers' own reports (`{prefix}:worker:{name}` in a Redis result store,
written every stats_interval_s and expiring 30 s after a worker stops): they know each held job's
real prompt length. Without a report store, the queue's in-flight work stands in for it.

Bodies are read up to `sample_limit` per kind and the rest counted at the sample's mean, so one
reading costs a few round trips whatever the queue's length. How stale: one reading per exporter
interval, plus up to stats_interval_s for the reports, plus (SQS) the approximate counters' own
lag of about a minute.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from qworker.worker import constants
from qworker.worker.demand import PoolSizing, Work, body_blocks, extrapolate

logger = logging.getLogger(__name__)

DEFAULT_SAMPLE_LIMIT = 500


@dataclass(frozen=True)
class QueueWork:
    waiting: Work
    in_flight: Work


@dataclass(frozen=True)
class WorkerReport:
    """What a live worker says about itself (from the stats it writes)."""

    name: str
    num_kv_blocks: int
    # Blocks its held jobs will reach (see demand.py).
    num_demand_blocks: int
    num_jobs_held: int


class Backlog(Protocol):
    def read(self, live_workers: set[str] | None) -> QueueWork:
        """The queue's work. `live_workers`: the names of the workers that reported (None: no
        report store, every holder counts as live)."""
        ...

    def close(self) -> None: ...


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- Redis Streams ---------------------------------------------------------------------------


class RedisStreamBacklog:
    def __init__(
        self,
        redis: Any,
        sizing: PoolSizing,
        *,
        stream: str = constants.DEFAULT_STREAM,
        group: str = constants.DEFAULT_GROUP,
        lease_timeout_s: float = 30.0,
        sample_limit: int = DEFAULT_SAMPLE_LIMIT,
    ) -> None:
        self.redis = redis
        self.sizing = sizing
        self.stream = stream
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
            if _text(group["name"]) == self.group:
                return group
        return None

    def _bodies_blocks(self, entries: list[tuple[Any, dict[Any, Any]]]) -> list[int]:
        field = constants.FIELD_BODY.encode()
        blocks = []
        for _, fields in entries:
            body = fields.get(field, fields.get(constants.FIELD_BODY))
            blocks.append(body_blocks(body, self.sizing) if body is not None else 1)
        return blocks

    def read(self, live_workers: set[str] | None) -> QueueWork:
        lane = self._read_stream(constants.high_lane_stream(self.stream), live_workers)
        main = self._read_stream(self.stream, live_workers)
        return QueueWork(lane.waiting + main.waiting, lane.in_flight + main.in_flight)

    def _read_stream(self, stream: str, live_workers: set[str] | None) -> QueueWork:
        num_entries = int(self.redis.xlen(stream))
        if num_entries == 0:
            return QueueWork(Work(), Work())
        group = self._group_info(stream)
        if group is None:
            # No worker ever joined (scale from zero): every entry waits.
            sample = self.redis.xrange(stream, "-", "+", count=self.sample_limit)
            return QueueWork(extrapolate(self._bodies_blocks(sample), num_entries, self.sizing), Work())
        num_pending = int(group["pending"])
        lag = group.get("lag")
        num_undelivered = int(lag) if lag is not None else max(0, num_entries - num_pending)
        last_id = _text(group["last-delivered-id"])
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
                live_workers is not None and _text(entry["consumer"]) not in live_workers
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


# -- Celery on Redis -------------------------------------------------------------------------


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
        queue: str = "qworker",
        sample_limit: int = DEFAULT_SAMPLE_LIMIT,
    ) -> None:
        self.redis = redis
        self.sizing = sizing
        self.queue = queue
        self.sample_limit = sample_limit

    def read(self, live_workers: set[str] | None) -> QueueWork:
        # kombu's Redis transport LPUSHes and pops from the right: the right end is the oldest.
        unacked_key = f"{self.queue}.unacked"
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


# -- SQS -------------------------------------------------------------------------------------


class SqsBacklog:
    def __init__(self, sqs: Any, sizing: PoolSizing, *, queue: str) -> None:
        self.sqs = sqs
        self.sizing = sizing
        self.queue_url = queue if queue.startswith("http") else sqs.get_queue_url(QueueName=queue)["QueueUrl"]

    def read(self, live_workers: set[str] | None) -> QueueWork:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesDelayed",
                "ApproximateNumberOfMessagesNotVisible",
            ],
        )["Attributes"]
        num_waiting = int(attrs.get("ApproximateNumberOfMessages", 0)) + int(
            attrs.get("ApproximateNumberOfMessagesDelayed", 0)
        )
        num_in_flight = int(attrs.get("ApproximateNumberOfMessagesNotVisible", 0))
        return QueueWork(
            extrapolate([], num_waiting, self.sizing), extrapolate([], num_in_flight, self.sizing)
        )

    def close(self) -> None:
        self.sqs.close()


# -- worker reports --------------------------------------------------------------------------


def parse_worker_report(name: str, stats: dict[str, Any]) -> WorkerReport | None:
    """A report from a worker's stats JSON (the WorkerStats dataclass as the Redis sink writes it).

    The held jobs' demand is `admission.num_demand_blocks` when the worker writes it; otherwise it
    is bounded from below by what admission knows: the blocks in use, those committed to held
    prompts and those reserved for growth.
    """
    admission = stats.get("admission")
    if not isinstance(admission, dict):
        return None
    demand = admission.get("num_demand_blocks")
    if demand is None:
        demand = (
            admission["num_total_blocks"]
            - admission["num_free_blocks"]
            + admission["num_committed_blocks"]
            + admission["num_reserved_blocks"]
        )
    return WorkerReport(
        name=name,
        num_kv_blocks=int(admission["num_total_blocks"]),
        num_demand_blocks=int(demand),
        num_jobs_held=int(admission["num_jobs_held"]),
    )


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def read_worker_reports(redis: Any, prefix: str = constants.DEFAULT_RESULT_PREFIX) -> list[WorkerReport]:
    """The reports of every worker whose stats key has not expired."""
    key_prefix = f"{prefix}:worker:"
    keys = list(redis.scan_iter(match=_glob_escape(key_prefix) + "*", count=500))
    if not keys:
        return []
    reports = []
    for key, payload in zip(keys, redis.mget(keys), strict=True):
        if payload is None:  # expired between SCAN and MGET
            continue
        try:
            report = parse_worker_report(_text(key)[len(key_prefix) :], json.loads(payload))
        except (ValueError, KeyError, TypeError):
            logger.warning("unreadable worker stats under %s", _text(key))
            continue
        if report is not None:
            reports.append(report)
    return reports


def running_work(reports: list[WorkerReport]) -> Work:
    return Work(sum(r.num_jobs_held for r in reports), sum(r.num_demand_blocks for r in reports))
