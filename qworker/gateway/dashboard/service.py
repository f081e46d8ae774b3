"""What the dashboard's routes read and do, off the event loop: the pool snapshot (cached for a
fraction of a second, so that many open pages cost one reading), the history samples (a
background thread writes one every interval into the result store's ring buffer, qworker/pool/
history.py, whichever replica gets there first), batches, a job by id, and the dead letters with
their two actions, which do what `qworker dlq replay` and `qworker dlq purge` do.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from qworker.backends.sink import ResultSink
from qworker.pool import batch_board
from qworker.pool.history import read_history
from qworker.pool.observer import DEAD_LETTERS_SHOWN, ObserverSettings, PoolObserver

logger = logging.getLogger(__name__)

# Longest text of a job the job page shows (its result's or its stream's so far).
MAX_JOB_TEXT_CHARS = 100_000


@dataclass(frozen=True)
class DashboardSettings:
    """The dashboard's options (`qworker dashboard`; a gateway uses the defaults)."""

    refresh_ms: int = field(
        default=1000, metadata={"help": "How often an open page asks for new data (at least 1000 ms)"}
    )
    history_interval_s: float = field(
        default=10.0, metadata={"help": "Seconds between the chart's samples (the ring buffer holds an hour)"}
    )
    # 1.5: a SIGKILLed worker shows stopped within 2 intervals + 1 s (1.5 intervals, a poll of the
    # page, a cached reading); a worker whose engine steps take longer than half its interval may
    # show stopped for a moment: raise it, or the worker's --stats-interval-s.
    stale_after_intervals: float = field(
        default=1.5,
        metadata={"help": "A worker whose report is this many report intervals old is shown stopped"},
    )
    snapshot_ttl_s: float = field(
        default=0.25, metadata={"help": "Seconds one reading of the pool serves every open page"}
    )

    def __post_init__(self) -> None:
        if self.refresh_ms < 1000:
            raise ValueError(
                f"refresh_ms must be >= 1000 (one request a second per page), got {self.refresh_ms}"
            )
        if self.history_interval_s <= 0 or self.stale_after_intervals <= 0 or self.snapshot_ttl_s < 0:
            raise ValueError("history_interval_s and stale_after_intervals must be > 0, snapshot_ttl_s >= 0")


def _dead_letter_view(letter: Any) -> dict[str, Any]:
    view = letter.as_dict()
    body = view.pop("body", "")
    view["body_preview"] = body[:500]
    return view


class DashboardService:
    def __init__(
        self, queue_url: str | None, sink: ResultSink, settings: DashboardSettings | None = None
    ) -> None:
        self.queue_url = queue_url
        self.sink = sink
        self.settings = settings or DashboardSettings()
        self._observer: PoolObserver | None = None
        self._lock = threading.Lock()
        self._snapshot: tuple[float, dict[str, Any]] | None = None
        self._closing = threading.Event()
        self._sampler: threading.Thread | None = None

    # -- lifecycle --

    def observer(self) -> PoolObserver:
        with self._lock:
            if self._observer is None:
                from qworker.backends.connections import resolve_url

                self._observer = PoolObserver(
                    resolve_url(self.queue_url),
                    self.sink,
                    settings=ObserverSettings(
                        stale_after_intervals=self.settings.stale_after_intervals,
                        history_interval_s=self.settings.history_interval_s,
                    ),
                )
            return self._observer

    def start(self) -> None:
        self._sampler = threading.Thread(target=self._sample_loop, name="dashboard-history", daemon=True)
        self._sampler.start()

    def close(self) -> None:
        self._closing.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        if self._observer is not None:
            self._observer.close()

    def _sample_loop(self) -> None:
        while not self._closing.is_set():
            try:
                observer = self.observer()
                observer.record(self.snapshot(max_age_s=0.0))
            except Exception as exc:  # the queue is away: try again at the next interval
                logger.debug("dashboard history sample failed: %s", exc)
            self._closing.wait(self.settings.history_interval_s)

    # -- reads --

    def snapshot(self, max_age_s: float | None = None) -> dict[str, Any]:
        ttl = self.settings.snapshot_ttl_s if max_age_s is None else max_age_s
        cached = self._snapshot
        if cached is not None and time.monotonic() - cached[0] <= ttl:
            return cached[1]
        snap = self.observer().snapshot()
        self._snapshot = (time.monotonic(), snap)
        return snap

    def overview(
        self, batch_offset: int, batch_limit: int, worker_offset: int, worker_limit: int
    ) -> dict[str, Any]:
        snap = self.snapshot()
        observer = self.observer()
        workers = snap["workers"]
        live = workers["live"]
        out: dict[str, Any] = {
            "now": snap["now"],
            "pool": {
                "totals": workers["totals"],
                "workers": live[worker_offset : worker_offset + worker_limit],
                "workers_offset": worker_offset,
                "workers_total": len(live),
                "stopped": workers["stopped"][:50],
            },
            "queues": snap["queues"],
            "history": [],
            "batches": {"items": [], "offset": batch_offset, "total": 0},
            "dead_letters": {"count": snap["queues"][0]["dead_letters"], "newest": self.dead_letters(10)},
        }
        if observer.redis is not None:
            out["history"] = read_history(observer.redis, observer.prefix)
            items, total = batch_board.read_batches(
                observer.redis, observer.prefix, batch_offset, batch_limit
            )
            out["batches"] = {"items": items, "offset": batch_offset, "total": total}
        return out

    def batch(self, batch_id: str, offset: int, limit: int) -> dict[str, Any] | None:
        observer = self.observer()
        if observer.redis is None:
            return None
        batch = batch_board.read_batch(observer.redis, observer.prefix, batch_id)
        if batch is None:
            return None
        rows, total = batch_board.read_failed_rows(observer.redis, observer.prefix, batch_id, offset, limit)
        return {"batch": batch, "failed_rows": {"items": rows, "offset": offset, "total": total}}

    def job(self, job_id: str) -> dict[str, Any]:
        result = self.sink.get_result(job_id)
        if result is not None:
            data = result.model_dump(mode="json")
            if isinstance(data.get("text"), str):
                data["text"] = data["text"][:MAX_JOB_TEXT_CHARS]
            data.pop("token_ids", None)
            data.pop("prompt_token_ids", None)
            for output in data.get("outputs") or []:
                output.pop("token_ids", None)
            return {"id": job_id, "found": True, "status": data.get("status"), "result": data}
        progress = self.sink.read_progress(job_id)
        last_error = self.sink.last_error(job_id)
        streamed = progress is not None and bool(progress.text or progress.token_ids)
        return {
            "id": job_id,
            "found": streamed or last_error is not None,
            "status": "running" if streamed else "queued or unknown",
            "result": None,
            "stream_text": progress.text[:MAX_JOB_TEXT_CHARS] if progress is not None else "",
            "stream_tokens": len(progress.token_ids) if progress is not None else 0,
            "last_error": last_error,
        }

    def dead_letters(self, limit: int = DEAD_LETTERS_SHOWN) -> list[dict[str, Any]]:
        """The newest dead letters, newest first."""
        observer = self.observer()
        if observer.dead_stream is not None:
            from qworker.backends.redis.dead_letters import RedisStreamDeadLetters

            entries = observer.queue_redis.xrevrange(observer.dead_stream, count=limit)
            return [_dead_letter_view(RedisStreamDeadLetters.letter_of_entry(i, f)) for i, f in entries]
        with self._dead_letter_queue() as dlq:
            letters = dlq.read()
        return [_dead_letter_view(d) for d in reversed(letters[-limit:])]

    # -- actions (admin) --

    def _dead_letter_queue(self) -> Any:
        from contextlib import closing

        from qworker.backends.connections import open_dead_letters, resolve_url

        return closing(open_dead_letters(resolve_url(self.queue_url)))

    def replay(self, ids: list[str] | None) -> dict[str, Any]:
        """`qworker dlq replay ID...` (None: --all): back on the queue, failed results removed."""
        with self._dead_letter_queue() as dlq:
            replayed = dlq.replay(ids, self.sink)
        self._snapshot = None
        found = {d.id for d in replayed}
        return {
            "replayed": [{"id": d.id, "job_id": d.job_id} for d in replayed],
            "not_found": sorted(set(ids or []) - found),
        }

    def purge(self) -> dict[str, Any]:
        """`qworker dlq purge --yes`."""
        with self._dead_letter_queue() as dlq:
            removed = dlq.purge()
        self._snapshot = None
        return {"removed": removed}
