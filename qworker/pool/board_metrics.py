"""The exporter's gauges beyond the KV-demand signal (issue 42): what the Grafana dashboard and the
alert rules (infra/grafana/qworker.json, infra/prometheus/qworker-rules.yaml) read of the queue,
the dead letters, the workers that stopped reporting, and the batches. One exporter per queue
exports them, so that gateway replicas (stateless, many) never count a batch twice.

Batch series carry a `batch_id` label only while the batch is not finished (bounded by the
batches running at once); a finished batch's series are removed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from qworker.pool import batch_board
from qworker.pool.observer import PoolObserver

logger = logging.getLogger(__name__)

BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *sorted(batch_board.TERMINAL))


class BoardMetrics:
    def __init__(self, registry: CollectorRegistry, observer: PoolObserver) -> None:
        self.observer = observer
        r = registry
        self.dead_letters = Gauge(
            "qworker_pool_dead_letters", "Messages in the dead-letter queue", registry=r
        )
        self.oldest_waiting = Gauge(
            "qworker_pool_oldest_waiting_seconds",
            "Age of the oldest job no worker has taken yet (0: none waits)",
            registry=r,
        )
        self.stopped_workers = Gauge(
            "qworker_pool_stopped_workers",
            "Workers whose stats report stopped (missed two report intervals) within the last hour",
            registry=r,
        )
        self.pool_kv_blocks = Gauge(
            "qworker_pool_kv_blocks",
            "KV blocks of the live workers together, by state",
            ["state"],
            registry=r,
        )
        self.batches = Gauge(
            "qworker_batches", "Batches the result store knows, by status", ["status"], registry=r
        )
        self.batch_rows = Gauge(
            "qworker_batch_rows",
            "Rows of each unfinished batch by state (completed, failed, remaining)",
            ["batch_id", "state"],
            registry=r,
        )
        self.batch_last_progress = Gauge(
            "qworker_batch_last_progress_timestamp_seconds",
            "When a row of each unfinished batch last finished (its start while none has)",
            ["batch_id"],
            registry=r,
        )
        for status in BATCH_STATUSES:
            self.batches.labels(status=status)
        self._batch_ids: set[str] = set()

    def safe_update(self) -> None:
        """update(), logging a failure: these gauges never stop the demand signal."""
        try:
            self.update()
        except Exception:
            logger.warning("reading the queue and batch gauges failed", exc_info=True)

    def update(self) -> None:
        snapshot = self.observer.snapshot()
        queue = snapshot["queues"][0]
        if queue["dead_letters"] is not None:
            self.dead_letters.set(queue["dead_letters"])
        self.oldest_waiting.set(queue["oldest_waiting_age_s"] or 0.0)
        totals = snapshot["workers"]["totals"]
        self.stopped_workers.set(totals["stopped_workers"])
        self.pool_kv_blocks.labels(state="used").set(totals["kv_blocks_used"])
        self.pool_kv_blocks.labels(state="total").set(totals["kv_blocks_total"])
        self.observer.record(snapshot)
        if self.observer.redis is None:
            return
        batches, _ = batch_board.read_batches(self.observer.redis, self.observer.prefix, 0, 1000)
        counts = dict.fromkeys(BATCH_STATUSES, 0)
        active = set()
        for batch in batches:
            counts[batch.get("status", "in_progress")] = counts.get(batch.get("status", "in_progress"), 0) + 1
            if batch.get("status") in batch_board.TERMINAL:
                continue
            batch_id = str(batch["id"])
            active.add(batch_id)
            self.batch_rows.labels(batch_id=batch_id, state="completed").set(batch.get("completed") or 0)
            self.batch_rows.labels(batch_id=batch_id, state="failed").set(batch.get("failed") or 0)
            self.batch_rows.labels(batch_id=batch_id, state="remaining").set(batch.get("remaining") or 0)
            progress_at = batch.get("last_progress_at") or batch.get("started_at") or batch.get("created_at")
            self.batch_last_progress.labels(batch_id=batch_id).set(progress_at or time.time())
        for status, n in counts.items():
            self.batches.labels(status=status).set(n)
        for gone in self._batch_ids - active:
            for state in ("completed", "failed", "remaining"):
                self._remove(self.batch_rows, gone, state)
            self._remove(self.batch_last_progress, gone)
        self._batch_ids = active

    @staticmethod
    def _remove(gauge: Gauge, *labels: str) -> None:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)


def open_board_metrics(
    registry: CollectorRegistry, queue_url: str, stats_redis: Any, stats_prefix: str
) -> BoardMetrics | None:
    """The gauges for a queue whose workers report to a Redis result store; None (and a log
    line) where they cannot be read: the demand signal never depends on them."""
    try:
        observer = PoolObserver(queue_url, None, results_redis=stats_redis, results_prefix=stats_prefix)
    except Exception as exc:
        logger.warning("no queue and batch gauges for the dashboard: %s", exc)
        return None
    return BoardMetrics(registry, observer)
