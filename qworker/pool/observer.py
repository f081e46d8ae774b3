"""What the dashboard and the exporter see of a pool, read only from the workers' stats reports,
the queue (without taking anything) and the result store; never from a worker's internals.

- workers: each stats report (`{prefix}:worker:{name}`); a report older than
  `stale_after_intervals` of its worker's report interval is a worker that stopped reporting. The
  last report of every worker seen is kept in `{prefix}:dash:workers` (a hash, pruned after
  `forget_after_s`), so that a stopped worker stays listed after its stats key expires.
- the queue: per stream (Redis Streams: the priority lane, the shared stream and each affinity
  lane that holds entries) its waiting and in-flight jobs and blocks, as the exporter's backlog
  reader counts them, and its oldest waiting entry's age; the pool's KV demand (demand.py); the
  dead letters' count. Other queues: their backlog reader's totals.
- batches (batch_board.py) and one job by id (the result store).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from qworker.backends import BACKENDS
from qworker.backends.backlog import Backlog, QueueWork, parse_worker_report, running_work
from qworker.backends.redis import keys
from qworker.backends.sink import ResultSink
from qworker.backends.urls import url_scheme
from qworker.pool import batch_board
from qworker.pool.demand import PoolSizing, Work, pool_demand
from qworker.pool.history import record_sample
from qworker.utils import as_text

logger = logging.getLogger(__name__)

DEFAULT_STALE_AFTER_INTERVALS = 2.0
# A report without an interval (an older worker) is stale after this.
DEFAULT_REPORT_INTERVAL_S = 1.0
DEFAULT_FORGET_AFTER_S = 3600.0
DEAD_LETTERS_SHOWN = 50


def is_redis_streams(url: str) -> bool:
    return BACKENDS.get(url_scheme(url)) == BACKENDS["redis"]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _entry_ms(entry_id: Any) -> int | None:
    try:
        return int(as_text(entry_id).split("-")[0])
    except (ValueError, IndexError):
        return None


@dataclass
class ObserverSettings:
    stale_after_intervals: float = DEFAULT_STALE_AFTER_INTERVALS
    forget_after_s: float = DEFAULT_FORGET_AFTER_S
    history_interval_s: float = 10.0


def worker_view(name: str, report: dict[str, Any], now: float, settings: ObserverSettings) -> dict[str, Any]:
    """One worker as the dashboard shows it, from its stats report (older reports lack fields:
    those are None)."""
    admission = report.get("admission") or {}
    hardware = report.get("hardware") or {}
    total = admission.get("num_total_blocks")
    free = admission.get("num_free_blocks")
    reported_at = report.get("reported_at")
    interval = report.get("report_interval_s") or DEFAULT_REPORT_INTERVAL_S
    age = None if reported_at is None else max(0.0, now - float(reported_at))
    stale = age is not None and age > settings.stale_after_intervals * interval
    held = admission.get("num_jobs_held")
    waiting = report.get("num_waiting", admission.get("num_jobs_not_started"))
    running = report.get("num_running")
    if running is None and held is not None and waiting is not None:
        running = held - waiting
    return {
        "id": name,
        "state": "stopped" if stale else "live",
        "host": report.get("host"),
        "pid": report.get("pid"),
        "device": hardware.get("device"),
        "device_name": hardware.get("device_name"),
        "model": report.get("model"),
        "dtype": hardware.get("dtype"),
        "quantization": report.get("quantization"),
        "adapters": report.get("adapters"),
        "kv_blocks_used": None if total is None or free is None else total - free,
        "kv_blocks_total": total,
        "block_size": hardware.get("block_size"),
        "num_running": running,
        "num_waiting": waiting,
        "num_jobs_held": held,
        "output_tokens_per_s": report.get("output_tokens_per_s"),
        "num_completed": report.get("num_completed"),
        "num_failed": report.get("num_failed"),
        "num_dead_lettered": report.get("num_dead_lettered"),
        "started_at": report.get("started_at"),
        "reported_at": reported_at,
        "report_age_s": age,
        "report_interval_s": report.get("report_interval_s"),
    }


def pool_totals(live: list[dict[str, Any]], stopped: list[dict[str, Any]]) -> dict[str, Any]:
    def total(field: str) -> float:
        return sum(w[field] or 0 for w in live)

    return {
        "live_workers": len(live),
        "stopped_workers": len(stopped),
        "kv_blocks_used": total("kv_blocks_used"),
        "kv_blocks_total": total("kv_blocks_total"),
        "num_running": total("num_running"),
        "num_waiting": total("num_waiting"),
        "num_jobs_held": total("num_jobs_held"),
        "output_tokens_per_s": total("output_tokens_per_s"),
        "num_completed": total("num_completed"),
        "num_failed": total("num_failed"),
    }


class PoolObserver:
    """Reads one queue and its result store. Blocking (redis-py); cheap enough to call once a
    second per open page (a few pipelined round trips)."""

    def __init__(
        self,
        queue_url: str,
        sink: ResultSink | None,
        *,
        sizing: PoolSizing | None = None,
        settings: ObserverSettings | None = None,
        lease_timeout_s: float | None = None,
        results_redis: Any = None,
        results_prefix: str | None = None,
    ) -> None:
        """The result store is `sink`'s Redis, or `results_redis` under `results_prefix`."""
        from qworker.backends.connections import open_backlog, resolve_url

        self.queue_url = resolve_url(queue_url)
        self.sink = sink
        self.sizing = sizing or PoolSizing()
        self.settings = settings or ObserverSettings()
        found = batch_board.redis_of_sink(sink) if sink is not None else None
        self.redis, self.prefix = found if found is not None else (None, keys.DEFAULT_RESULT_PREFIX)
        if results_redis is not None:
            self.redis, self.prefix = results_redis, results_prefix or keys.DEFAULT_RESULT_PREFIX
        self.backlog: Backlog = open_backlog(self.queue_url, self.sizing, lease_timeout_s)
        self.queue_name = self.queue_url.split("?")[0]
        self.stream: str | None = None
        self.dead_stream: str | None = None
        self.queue_redis: Any = None
        self._cluster = False
        if is_redis_streams(self.queue_url):
            from qworker.backends.redis.connection import key_layout, parse_redis_url
            from qworker.backends.redis.queue_streams import queue_streams

            parsed = parse_redis_url(self.queue_url)
            self.queue_redis = self.backlog.redis  # type: ignore[attr-defined]
            self.stream, self.dead_stream = queue_streams(self.queue_url, parsed, self.queue_redis)
            self._cluster = key_layout(self.queue_url).hash_tags
            self.queue_name = self.stream

    def close(self) -> None:
        self.backlog.close()

    # -- workers --

    def _raw_reports(self) -> dict[str, dict[str, Any]]:
        if self.redis is None:
            return {}
        key_prefix = keys.worker_stats_prefix(self.prefix)
        stats_keys = list(self.redis.scan_iter(match=_glob_escape(key_prefix) + "*", count=500))
        if not stats_keys:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for key in stats_keys:
            pipe.get(key)
        out = {}
        for key, payload in zip(stats_keys, pipe.execute(), strict=True):
            if payload is None:
                continue
            try:
                report = json.loads(payload)
            except ValueError:
                continue
            if isinstance(report, dict):
                out[as_text(key)[len(key_prefix) :]] = report
        return out

    def workers(self, now: float | None = None) -> dict[str, Any]:
        """Live workers, those that stopped reporting, and the pool's totals (over live ones)."""
        now = time.time() if now is None else now
        reports = self._raw_reports()
        seen_key = f"{self.prefix}:dash:workers"
        remembered: dict[str, dict[str, Any]] = {}
        if self.redis is not None:
            if reports:
                self.redis.hset(seen_key, mapping={name: json.dumps(r) for name, r in reports.items()})
                self.redis.expire(seen_key, int(self.settings.forget_after_s))
            forget = []
            for raw_name, raw in self.redis.hgetall(seen_key).items():
                name = as_text(raw_name)
                if name in reports:
                    continue
                try:
                    report = json.loads(raw)
                except ValueError:
                    forget.append(name)
                    continue
                reported_at = report.get("reported_at") if isinstance(report, dict) else None
                if reported_at is None or now - float(reported_at) > self.settings.forget_after_s:
                    forget.append(name)
                    continue
                remembered[name] = report
            if forget:
                self.redis.hdel(seen_key, *forget)
        views = [worker_view(name, r, now, self.settings) for name, r in reports.items()]
        for name, report in remembered.items():
            view = worker_view(name, report, now, self.settings)
            view["state"] = "stopped"
            views.append(view)
        live = sorted((w for w in views if w["state"] == "live"), key=lambda w: w["id"])
        stopped = sorted(
            (w for w in views if w["state"] == "stopped"), key=lambda w: -(w["reported_at"] or 0)
        )
        live_names = {w["id"] for w in live}
        parsed = [parse_worker_report(name, r) for name, r in reports.items() if name in live_names]
        return {
            "live": live,
            "stopped": stopped,
            "totals": pool_totals(live, stopped),
            "_reports": [r for r in parsed if r is not None],
        }

    # -- the queue --

    def _streams(self) -> list[tuple[str, str]]:
        """(kind, stream) of every stream of a Redis Streams queue."""
        assert self.stream is not None
        from qworker.backends.redis.lanes import QueueStreams

        recorded = self.queue_redis.get(keys.lanes_config_key(self.stream))
        num_lanes = int(recorded) if recorded is not None else 1
        streams = QueueStreams.of(self.stream, num_lanes, cluster=self._cluster)
        return [("priority", streams.high), ("shared", streams.stream)] + [
            (f"lane {i}", lane) for i, lane in enumerate(streams.lanes)
        ]

    def _oldest_waiting_age_s(self, stream: str, group: str, now: float) -> float | None:
        import redis as redis_lib

        last_id = "0-0"
        try:
            for info in self.queue_redis.xinfo_groups(stream):
                if as_text(info["name"]) == group:
                    last_id = as_text(info["last-delivered-id"])
        except redis_lib.ResponseError:
            return None
        entries = self.queue_redis.xrange(stream, f"({last_id}", "+", count=1)
        if not entries:
            return None
        ms = _entry_ms(entries[0][0])
        return None if ms is None else max(0.0, now - ms / 1000.0)

    def queue(self, live_workers: set[str] | None, running: Work, capacity: int | None) -> dict[str, Any]:
        now = time.time()
        lanes: list[dict[str, Any]] = []
        oldest: float | None = None
        dead_letters: int | None = None
        num_lanes = 1
        if self.stream is not None:
            streams = self._streams()
            num_lanes = max(1, len(streams) - 2)
            pipe = self.queue_redis.pipeline(transaction=False)
            for _, stream in streams:
                pipe.xlen(stream)
            pipe.xlen(self.dead_stream)
            *sizes, dead_letters = [int(n) for n in pipe.execute()]
            waiting, in_flight = Work(), Work()
            group = self.backlog.group  # type: ignore[attr-defined]
            for (kind, stream), size in zip(streams, sizes, strict=True):
                if size == 0 and kind.startswith("lane"):
                    continue  # of 256 lanes, show those that hold something
                work = QueueWork(Work(), Work())
                age = None
                if size:
                    # The backlog reader's own per-stream count (what the exporter sums).
                    work = self.backlog.read_stream(stream, size, live_workers)  # type: ignore[attr-defined]
                    age = self._oldest_waiting_age_s(stream, group, now)
                waiting, in_flight = waiting + work.waiting, in_flight + work.in_flight
                if age is not None:
                    oldest = age if oldest is None else max(oldest, age)
                lanes.append(
                    {
                        "name": stream,
                        "kind": kind,
                        "depth": work.waiting.num_jobs,
                        "in_flight": work.in_flight.num_jobs,
                        "waiting_blocks": work.waiting.num_blocks,
                        "oldest_waiting_age_s": age,
                    }
                )
            total = QueueWork(waiting, in_flight)
        else:
            total = self.backlog.read(live_workers)
        demand = pool_demand(total.waiting, running, self.sizing, capacity)
        return {
            "name": self.queue_name,
            "scheme": url_scheme(self.queue_url),
            "depth": total.waiting.num_jobs,
            "in_flight": total.in_flight.num_jobs,
            "waiting_blocks": total.waiting.num_blocks,
            "running_blocks": demand.running.num_blocks,
            "demand_blocks": demand.demand_blocks,
            "capacity_blocks": demand.capacity_blocks,
            "desired_workers": demand.desired_workers,
            "oldest_waiting_age_s": oldest,
            "dead_letters": dead_letters,
            "num_lanes": num_lanes,
            "lanes": lanes,
        }

    def snapshot(self) -> dict[str, Any]:
        """Workers and the queue, read together (the queue's live holders are the live workers)."""
        now = time.time()
        workers = self.workers(now)
        reports = workers.pop("_reports")
        capacity = self.sizing.capacity_blocks or (min(r.num_kv_blocks for r in reports) if reports else None)
        live_names = {w["id"] for w in workers["live"]} if self.redis is not None else None
        queue = self.queue(live_names, running_work(reports), capacity)
        return {"now": now, "workers": workers, "queues": [queue]}

    # -- history --

    def sample(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        queue = snapshot["queues"][0]
        return {
            "t": snapshot["now"],
            "depth": queue["depth"],
            "in_flight": queue["in_flight"],
            "waiting_blocks": queue["waiting_blocks"],
            "demand_blocks": queue["demand_blocks"],
            "capacity_blocks": queue["capacity_blocks"],
            "desired_workers": queue["desired_workers"],
            "workers": snapshot["workers"]["totals"]["live_workers"],
            "kv_blocks_total": snapshot["workers"]["totals"]["kv_blocks_total"],
        }

    def record(self, snapshot: dict[str, Any]) -> bool:
        if self.redis is None:
            return False
        return record_sample(
            self.redis, self.prefix, self.sample(snapshot), interval_s=self.settings.history_interval_s
        )
