"""What the reader threads of a queue- or http-mode system hand the run loop: a text chunk of a
request seen at time t, or its end; `apply_events` applies them to the run in the loop's thread.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.run import IDLE_POLL_S, Run


@dataclass(frozen=True)
class StreamChunk:
    """A reader thread saw a text delta of the record's job at time t."""

    record: RequestRecord
    t: float


@dataclass(frozen=True)
class StreamDone:
    """A reader thread read the job's result (or gave up on it) at time t."""

    record: RequestRecord
    t: float
    status: RequestStatus
    error: str | None = None
    num_output_tokens: int | None = None
    queue_wait_s: float | None = None
    num_cached_tokens: int | None = None
    worker: str | None = None


def apply_events(run: Run, events: queue.Queue[StreamChunk | StreamDone], wake: float | None) -> None:
    """Apply the reader threads' events to the run: wait for the first until `wake` (or a poll
    interval), then take every one already there."""
    timeout = IDLE_POLL_S if wake is None else max(0.0, wake - run.now())
    try:
        event = events.get(timeout=timeout)
    except queue.Empty:
        return
    while True:
        _apply(run, event)
        try:
            event = events.get_nowait()
        except queue.Empty:
            return


def _apply(run: Run, event: StreamChunk | StreamDone) -> None:
    record = event.record
    if record.status is not None:
        return  # the loop timed it out first
    if isinstance(event, StreamChunk):
        run.emit(record, event.t, 0)
        return
    if event.num_output_tokens is not None:
        record.num_output_tokens = event.num_output_tokens
    record.queue_wait_s = event.queue_wait_s
    record.num_cached_tokens = event.num_cached_tokens
    record.worker = event.worker
    run.finish(record, event.status, event.t, event.error)
