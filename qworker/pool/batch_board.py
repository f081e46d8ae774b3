"""Every batch the result store knows, for the dashboard and the exporter: its status, its rows
done, failed and remaining, its errors by code and its failed rows. Written by whoever runs the
batch: the gateway's batch driver (OpenAI's Batch API) and `qworker batch --queue`; read by the
dashboard and the exporter. Redis result stores only (the rest have nowhere cheap to list).

    {prefix}:batches                 sorted set: batch id -> created_at (the newest MAX_BATCHES)
    {prefix}:batch:{id}:board        JSON of the batch's state (below), kept BOARD_TTL_S
    {prefix}:batch:{id}:failed       list of JSON failed rows, the first MAX_FAILED_ROWS

State: id, source ("api" | "cli"), status (OpenAI's batch statuses; `qworker batch` uses
in_progress, completed, failed), endpoint, total, completed, failed, errors_by_code {code: n},
created_at, started_at, finished_at, updated_at, last_progress_at (when a row last finished),
and run_started_at / run_done_at_start (this run's start, and the rows done then), from which a
reader gets rows/s and an ETA.

A writer buffers in memory and writes at most every `flush_interval_s` (and at each status
change), one pipelined round trip each time.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

BOARD_TTL_S = 7 * 24 * 3600
MAX_BATCHES = 10_000
MAX_FAILED_ROWS = 1000
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


def index_key(prefix: str) -> str:
    return f"{prefix}:batches"


def board_key(prefix: str, batch_id: str) -> str:
    return f"{prefix}:batch:{batch_id}:board"


def failed_key(prefix: str, batch_id: str) -> str:
    return f"{prefix}:batch:{batch_id}:failed"


def redis_of_sink(sink: Any) -> tuple[Any, str] | None:
    """The Redis client and key prefix behind a result store (a split store's final part, else
    its delta part), or None."""
    from qworker.backends.redis.results import RedisResultSink
    from qworker.backends.split_sink import SplitSink

    if isinstance(sink, SplitSink):
        return redis_of_sink(sink.final) or redis_of_sink(sink.stream)
    if isinstance(sink, RedisResultSink):
        return sink.redis, sink.prefix
    return None


class BatchBoard:
    """The writer of one batch's state."""

    def __init__(
        self,
        redis: Any,
        prefix: str,
        batch_id: str,
        *,
        source: str,
        flush_interval_s: float = 0.5,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.batch_id = batch_id
        self.flush_interval_s = flush_interval_s
        now = time.time()
        self.state: dict[str, Any] = state or {
            "id": batch_id,
            "source": source,
            "status": "validating",
            "endpoint": None,
            "total": None,
            "completed": 0,
            "failed": 0,
            "errors_by_code": {},
            "created_at": now,
            "started_at": None,
            "finished_at": None,
            "updated_at": now,
            "last_progress_at": None,
        }
        self.state["run_started_at"] = now
        self.state["run_done_at_start"] = self.state["completed"] + self.state["failed"]
        self._codes: Counter[str] = Counter(self.state.get("errors_by_code") or {})
        self._failed_rows: list[str] = []
        self._last_flush = 0.0
        self._is_new = state is None

    @classmethod
    def open(cls, redis: Any, prefix: str, batch_id: str, *, source: str) -> BatchBoard:
        """The batch's board, carrying on the stored one (a rerun, or another replica's driver)."""
        raw = redis.get(board_key(prefix, batch_id))
        state = None
        if raw is not None:
            try:
                state = json.loads(raw)
            except ValueError:
                state = None
        return cls(redis, prefix, batch_id, source=source, state=state if isinstance(state, dict) else None)

    @classmethod
    def of_sink(cls, sink: Any, batch_id: str, *, source: str) -> BatchBoard | None:
        found = redis_of_sink(sink)
        return None if found is None else cls.open(found[0], found[1], batch_id, source=source)

    # -- what the runner says --

    def start_run(self, *, total: int | None, done_before: int, endpoint: str | None = None) -> None:
        """A run begins with `done_before` rows already done (a rerun); counts stored by an earlier
        run that do not add up to them are started over."""
        if self.state["completed"] + self.state["failed"] != done_before:
            self.state.update(completed=done_before, failed=0)
            self._codes.clear()
        now = time.time()
        self.state.update(
            total=total,
            run_started_at=now,
            run_done_at_start=done_before,
            finished_at=None,
            endpoint=endpoint,
        )
        self.state["status"] = "in_progress"
        self.state["started_at"] = self.state.get("started_at") or now
        self.flush(force=True)

    def set_status(self, status: str, **fields: Any) -> None:
        now = time.time()
        self.state.update(fields)
        if self.state["status"] != status:
            self.state["status"] = status
            if status == "in_progress" and self.state.get("started_at") is None:
                self.state["started_at"] = now
            if status in TERMINAL:
                self.state["finished_at"] = now
        self.flush(force=True)

    def set_counts(self, *, total: int | None, completed: int, failed: int) -> None:
        """Counts from an authority (the Batch API's request_counts)."""
        if completed + failed != self.state["completed"] + self.state["failed"]:
            self.state["last_progress_at"] = time.time()
        self.state.update(total=total, completed=completed, failed=failed)

    def observe_line(self, line: Any) -> None:
        """One finished row (a BatchOutputLine): counted, and kept when it failed."""
        self.state["last_progress_at"] = time.time()
        if not line.is_error:
            self.state["completed"] += 1
        else:
            self.state["failed"] += 1
            code, message = "error", ""
            status_code = line.response.status_code if line.response is not None else None
            if line.error is not None:
                code, message = line.error.code or "error", line.error.message or ""
            self._codes[code] += 1
            self._failed_rows.append(
                json.dumps(
                    {
                        "custom_id": line.custom_id,
                        "code": code,
                        "status_code": status_code,
                        "message": message[:2000],
                        "at": time.time(),
                    }
                )
            )
        self.flush()

    # -- writes --

    def flush(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_flush < self.flush_interval_s:
            return
        self._last_flush = now
        self.state["updated_at"] = now
        self.state["errors_by_code"] = dict(self._codes)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(board_key(self.prefix, self.batch_id), json.dumps(self.state), ex=BOARD_TTL_S)
        if self._is_new:
            index = index_key(self.prefix)
            pipe.zadd(index, {self.batch_id: self.state["created_at"]}, nx=True)
            pipe.zremrangebyrank(index, 0, -MAX_BATCHES - 1)
            pipe.expire(index, BOARD_TTL_S)
        if self._failed_rows:
            key = failed_key(self.prefix, self.batch_id)
            pipe.rpush(key, *self._failed_rows)
            pipe.ltrim(key, 0, MAX_FAILED_ROWS - 1)
            pipe.expire(key, BOARD_TTL_S)
        pipe.execute()
        self._failed_rows = []
        self._is_new = False


# -- readers --


def describe(state: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """A stored state with what a reader derives: remaining, progress, rows/s and ETA."""
    now = time.time() if now is None else now
    total = state.get("total")
    done = int(state.get("completed") or 0) + int(state.get("failed") or 0)
    remaining = None if total is None else max(0, int(total) - done)
    end = state.get("finished_at") or state.get("updated_at") or now
    run_started = state.get("run_started_at") or state.get("started_at")
    rows_per_s = None
    if run_started is not None and end > run_started:
        rows_per_s = max(0, done - int(state.get("run_done_at_start") or 0)) / (end - run_started)
    eta_s = None
    if remaining is not None and state.get("status") not in TERMINAL:
        eta_s = 0.0 if remaining == 0 else (remaining / rows_per_s if rows_per_s else None)
    return {
        **state,
        "done": done,
        "remaining": remaining,
        "progress": (done / total) if total else (1.0 if state.get("status") == "completed" else 0.0),
        "rows_per_s": rows_per_s,
        "eta_s": eta_s,
    }


def read_batch(redis: Any, prefix: str, batch_id: str) -> dict[str, Any] | None:
    raw = redis.get(board_key(prefix, batch_id))
    if raw is None:
        return None
    try:
        state = json.loads(raw)
    except ValueError:
        return None
    return describe(state) if isinstance(state, dict) else None


def read_batches(
    redis: Any, prefix: str, offset: int = 0, limit: int = 20
) -> tuple[list[dict[str, Any]], int]:
    """A page of batches, newest first, and how many the index holds."""
    index = index_key(prefix)
    total = int(redis.zcard(index))
    ids = [
        raw.decode() if isinstance(raw, bytes) else str(raw)
        for raw in redis.zrevrange(index, offset, offset + limit - 1)
    ]
    if not ids:
        return [], total
    pipe = redis.pipeline(transaction=False)
    for batch_id in ids:
        pipe.get(board_key(prefix, batch_id))
    out = []
    gone = []
    for batch_id, raw in zip(ids, pipe.execute(), strict=True):
        if raw is None:
            gone.append(batch_id)
            continue
        try:
            state = json.loads(raw)
        except ValueError:
            continue
        if isinstance(state, dict):
            out.append(describe(state))
    if gone:  # boards that expired: drop them from the index
        redis.zrem(index, *gone)
    return out, total


def read_active_batches(redis: Any, prefix: str, limit: int = 1000) -> list[dict[str, Any]]:
    """Batches not in a terminal status, among the newest `limit`."""
    batches, _ = read_batches(redis, prefix, 0, limit)
    return [b for b in batches if b.get("status") not in TERMINAL]


def read_failed_rows(
    redis: Any, prefix: str, batch_id: str, offset: int = 0, limit: int = 50
) -> tuple[list[dict[str, Any]], int]:
    key = failed_key(prefix, batch_id)
    total = int(redis.llen(key))
    rows = []
    for raw in redis.lrange(key, offset, offset + limit - 1):
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows, total
