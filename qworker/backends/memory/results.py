"""Result store in this process's memory: results, live deltas, cancel flags, worker stats.

The pair of queue.py, for unit tests of the worker loop and for trying qworker without
a server. `memory://NAME` opens the store NAME, shared by the whole process (a worker and a
client in one process meet there). As in every store, the first result written for a job id is
the one kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from qworker.backends.memory.queue import URL_PARAMS, Journal
from qworker.backends.sink import Delta, Progress, ResultSink, latest_attempt, progress_of
from qworker.backends.urls import named_location
from qworker.jobs.job import JobResult


class MemoryResultSink(ResultSink):
    """`journal`, when given, records ("deltas", job id) for each delta and ("result", job id)
    for each stored result (see queue.py)."""

    def __init__(self, journal: Journal | None = None) -> None:
        self.journal = journal
        self.results: dict[str, JobResult] = {}
        self.deltas: dict[str, list[Delta]] = {}
        # job id -> status, once its live stream has ended.
        self.ended: dict[str, str] = {}
        self.cancel_requested: set[str] = set()
        self.worker_stats: dict[str, Any] = {}
        self.last_errors: dict[str, str] = {}
        self._changed = threading.Condition()

    def write_deltas(self, deltas: list[Delta]) -> None:
        with self._changed:
            for delta in deltas:
                self.deltas.setdefault(delta.job_id, []).append(delta)
                if self.journal is not None:
                    self.journal.append(("deltas", delta.job_id))
            self._changed.notify_all()

    def write_result(self, result: JobResult) -> bool:
        with self._changed:
            is_stored = result.id not in self.results
            if is_stored:
                self.results[result.id] = result.model_copy(deep=True)
                if self.journal is not None:
                    self.journal.append(("result", result.id))
            self.ended.setdefault(result.id, result.status.value)
            self._changed.notify_all()
            return is_stored

    def end_deltas(self, job_id: str, status: str) -> None:
        with self._changed:
            self.ended.setdefault(job_id, status)
            self._changed.notify_all()

    def has_result(self, job_id: str) -> bool:
        with self._changed:
            return job_id in self.results

    def get_result(self, job_id: str) -> JobResult | None:
        with self._changed:
            result = self.results.get(job_id)
            return result.model_copy(deep=True) if result is not None else None

    def read_deltas(self, job_id: str, timeout_s: float | None) -> Iterator[Delta]:
        num_read = 0
        last_progress = time.monotonic()
        while True:
            with self._changed:
                new = self.deltas.get(job_id, [])[num_read:]
                is_ended = job_id in self.ended or job_id in self.results
                if not new and not is_ended:
                    wait_s = None if timeout_s is None else timeout_s - (time.monotonic() - last_progress)
                    if wait_s is not None and wait_s <= 0:
                        raise TimeoutError(f"no output from job {job_id} for {timeout_s:.1f}s")
                    self._changed.wait(wait_s)
                    continue
            # Yield outside the lock: the reader may be slow, the writer must not wait on it.
            # What is there at the first read starts at its latest attempt, as in the Redis store.
            yield from (latest_attempt(new) if num_read == 0 else new)
            num_read += len(new)
            last_progress = time.monotonic()
            if not new and is_ended:
                return

    def read_progress(self, job_id: str) -> Progress:
        with self._changed:
            return progress_of(list(self.deltas.get(job_id, [])))

    def delete_result(self, job_id: str) -> None:
        with self._changed:
            for store in (self.results, self.deltas, self.ended, self.last_errors):
                store.pop(job_id, None)

    def request_cancel(self, job_id: str) -> None:
        with self._changed:
            self.cancel_requested.add(job_id)

    def cancelled_ids(self, job_ids: list[str]) -> set[str]:
        with self._changed:
            return self.cancel_requested.intersection(job_ids)

    def write_last_errors(self, job_id_to_error: dict[str, str]) -> None:
        with self._changed:
            self.last_errors.update(job_id_to_error)

    def last_error(self, job_id: str) -> str | None:
        with self._changed:
            return self.last_errors.get(job_id)

    def write_worker_stats(self, worker_name: str, stats: Any) -> None:
        with self._changed:
            self.worker_stats[worker_name] = stats


# The named stores of memory:// URLs, shared by the whole process; each lives as long as it.
_named_sinks: dict[str, MemoryResultSink] = {}
_named_sinks_lock = threading.Lock()


def open_sink(url: str) -> MemoryResultSink:
    # The queue's parameters are allowed (and ignored): one memory:// URL may serve as both.
    name, _ = named_location(url, URL_PARAMS, "store; use memory://NAME")
    with _named_sinks_lock:
        sink = _named_sinks.get(name)
        if sink is None:
            sink = _named_sinks[name] = MemoryResultSink()
        return sink
