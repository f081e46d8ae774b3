"""The pool-demand exporter: reads the queue and the workers' reports every few seconds and serves
the signal (demand.py) as Prometheus gauges at /metrics, where KEDA's metrics-api scaler (or
Prometheus, for KEDA's prometheus scaler) reads it.

It runs beside the pool, not inside a worker: at zero workers nothing else could say that a job
waits. One exporter per queue; it holds no lease and takes nothing from the queue.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from qworker.backends import BACKENDS
from qworker.backends.backlog import Backlog, running_work
from qworker.backends.connections import open_backlog
from qworker.backends.redis import keys
from qworker.backends.redis.connection import parse_redis_url, redis_client
from qworker.backends.redis.reports import read_worker_reports
from qworker.backends.urls import InvalidURLError, redact_url, url_scheme
from qworker.health import HealthServer, HealthState
from qworker.pool.demand import PoolDemand, PoolSizing, pool_demand

logger = logging.getLogger(__name__)

DEFAULT_EXPORTER_PORT = 9100
DEFAULT_INTERVAL_S = 5.0


class PoolMetrics:
    """The signal as gauges, on their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.demand_blocks = Gauge(
            "qworker_pool_demand_blocks", "KV blocks the pool's waiting and running jobs need", registry=r
        )
        self.waiting_blocks = Gauge(
            "qworker_pool_waiting_blocks", "KV blocks the jobs no worker holds need", registry=r
        )
        self.running_blocks = Gauge(
            "qworker_pool_running_blocks", "KV blocks the jobs workers hold will reach", registry=r
        )
        self.waiting_jobs = Gauge("qworker_pool_waiting_jobs", "Jobs no worker holds", registry=r)
        self.running_jobs = Gauge("qworker_pool_running_jobs", "Jobs workers hold", registry=r)
        self.capacity_blocks = Gauge(
            "qworker_pool_capacity_blocks", "One worker's KV pool, in blocks", registry=r
        )
        self.desired_workers = Gauge(
            "qworker_pool_desired_workers",
            "ceil(demand / (capacity * target utilisation)), at least 1 while a job waits",
            registry=r,
        )
        self.workers = Gauge("qworker_pool_workers", "Workers whose stats report is live", registry=r)

    def update(self, demand: PoolDemand, num_workers: int | None) -> None:
        self.demand_blocks.set(demand.demand_blocks)
        self.waiting_blocks.set(demand.waiting.num_blocks)
        self.running_blocks.set(demand.running.num_blocks)
        self.waiting_jobs.set(demand.waiting.num_jobs)
        self.running_jobs.set(demand.running.num_jobs)
        if demand.capacity_blocks is not None:
            self.capacity_blocks.set(demand.capacity_blocks)
        self.desired_workers.set(demand.desired_workers)
        if num_workers is not None:
            self.workers.set(num_workers)


class PoolDemandReader:
    """One reading of the signal: the queue's work, and the running work from the reports when a
    report store is given (else from the queue's in-flight work)."""

    def __init__(
        self,
        backlog: Backlog,
        sizing: PoolSizing,
        *,
        stats_redis: Any = None,
        stats_prefix: str = keys.DEFAULT_RESULT_PREFIX,
    ) -> None:
        self.backlog = backlog
        self.sizing = sizing
        self.stats_redis = stats_redis
        self.stats_prefix = stats_prefix
        self.num_workers: int | None = None
        # The pool size the live workers last reported, when none is configured.
        self.reported_capacity_blocks: int | None = None
        self._warned_capacity: set[int] = set()

    def read(self) -> PoolDemand:
        reports = None
        if self.stats_redis is not None:
            reports = read_worker_reports(self.stats_redis, self.stats_prefix)
            if reports:
                self.reported_capacity_blocks = min(r.num_kv_blocks for r in reports)
            for report in reports:
                if self.sizing.capacity_blocks not in (None, report.num_kv_blocks):
                    self._warn_capacity(report.num_kv_blocks)
        work = self.backlog.read({r.name for r in reports} if reports is not None else None)
        running = running_work(reports) if reports is not None else work.in_flight
        self.num_workers = len(reports) if reports is not None else None
        return pool_demand(work.waiting, running, self.sizing, self.reported_capacity_blocks)

    def _warn_capacity(self, num_kv_blocks: int) -> None:
        if num_kv_blocks in self._warned_capacity:
            return
        self._warned_capacity.add(num_kv_blocks)
        logger.warning(
            "a worker reports a KV pool of %d blocks; the exporter sizes workers at %d (capacity_blocks)",
            num_kv_blocks,
            self.sizing.capacity_blocks,
        )

    def close(self) -> None:
        self.backlog.close()
        if self.stats_redis is not None:
            self.stats_redis.close()


def _is_redis_store(url: str) -> bool:
    """Whether `url` names a Redis result store (where workers write their stats reports)."""
    return BACKENDS.get(url_scheme(url)) == BACKENDS["redis"]


def default_stats_url(queue_url: str) -> str | None:
    """Where workers write their stats when the results go to their default store: the queue's own
    Redis. Other queues have no default report store."""
    return queue_url if _is_redis_store(queue_url) else None


def open_pool_demand_reader(
    queue_url: str,
    sizing: PoolSizing,
    *,
    stats_url: str | None = None,
    lease_timeout_s: float | None = None,
) -> PoolDemandReader:
    """`stats_url`: the workers' Redis result store (redis://...?prefix=...), where their reports
    live; by default the queue's Redis for a Redis Streams queue, else none."""
    stats_url = stats_url or default_stats_url(queue_url)
    stats_redis = None
    stats_prefix = keys.DEFAULT_RESULT_PREFIX
    if stats_url is not None:
        if not _is_redis_store(stats_url):
            raise InvalidURLError(f"worker stats live in a Redis result store, not {redact_url(stats_url)!r}")
        parsed = parse_redis_url(stats_url)
        stats_redis = redis_client(parsed.connection_url)
        stats_prefix = parsed.params.get("prefix", keys.DEFAULT_RESULT_PREFIX)
    return PoolDemandReader(
        open_backlog(queue_url, sizing, lease_timeout_s),
        sizing,
        stats_redis=stats_redis,
        stats_prefix=stats_prefix,
    )


def run_metrics_exporter(
    queue_url: str,
    sizing: PoolSizing,
    *,
    stats_url: str | None = None,
    host: str = "0.0.0.0",
    port: int = DEFAULT_EXPORTER_PORT,
    interval_s: float = DEFAULT_INTERVAL_S,
    stop: threading.Event | None = None,
    on_serving: Any = None,
) -> None:
    """Serve the pool signal on host:port until `stop` is set. /readyz is 200 once a reading
    succeeded and while they keep succeeding; /healthz fails when readings stop happening.
    `on_serving(server)` is called once the port is open (tests learn a port-0 server's port)."""
    stop = stop or threading.Event()
    metrics = PoolMetrics()
    state = HealthState(stall_timeout_s=max(60.0, 6 * interval_s))
    reader = open_pool_demand_reader(queue_url, sizing, stats_url=stats_url)
    # issue 42: dead letters, oldest waiting job, batches, and the dashboard's history samples.
    board = None
    if reader.stats_redis is not None:
        from qworker.pool.board_metrics import open_board_metrics

        board = open_board_metrics(metrics.registry, queue_url, reader.stats_redis, reader.stats_prefix)
    logger.info(
        "pool-demand exporter: queue %s, %s blocks per worker, target utilisation %.2f",
        redact_url(queue_url),
        sizing.capacity_blocks or "(as reported)",
        sizing.target_utilization,
    )
    with HealthServer(metrics.registry, state, host=host, port=port) as server:
        if on_serving is not None:
            on_serving(server)
        try:
            while not stop.is_set():
                state.tick()
                try:
                    demand = reader.read()
                except Exception:  # the queue is unreachable: not ready, keep trying
                    logger.warning("pool-demand reading failed", exc_info=True)
                    state.set_ready(False)
                else:
                    metrics.update(demand, reader.num_workers)
                    state.set_ready(True)
                    if board is not None:
                        board.safe_update()
                stop.wait(interval_s)
        finally:
            reader.close()
            if board is not None:
                board.observer.close()
