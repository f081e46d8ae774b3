"""What a queue holds, in jobs and KV blocks: the inputs of the pool-demand signal (demand.py).

Each queue backend reads its own (`open_backlog` of its package, e.g. redis/backlog.py), without
taking anything (no lease, no receive, no delivery counted):

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

Running demand prefers the workers' own reports (`{prefix}:worker:{name}` in a Redis result store
(redis/reports.py),
written every stats_interval_s and expiring 30 s after a worker stops): they know each held job's
real prompt length. Without a report store, the queue's in-flight work stands in for it.

Bodies are read up to `sample_limit` per kind and the rest counted at the sample's mean, so one
reading costs a few round trips whatever the queue's length. How stale: one reading per exporter
interval, plus up to stats_interval_s for the reports, plus (SQS) the approximate counters' own
lag of about a minute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from qworker.pool.demand import Work

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


def running_work(reports: list[WorkerReport]) -> Work:
    return Work(sum(r.num_jobs_held for r in reports), sum(r.num_demand_blocks for r in reports))
