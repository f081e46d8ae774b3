"""The gateway's side of the pool: submit, wait, stream and cancel through the worker's `Client`
(its producer and result store), from asyncio.

The Client is blocking (redis-py, boto3), so short calls run on a bounded thread pool, and each
live stream gets a thread of its own that reads the job's deltas (Client.stream, which handles
attempt markers) and hands them to the event loop. A stream's thread ends when the job's result is
stored, or when no output arrives for the request timeout, so that a client that went away leaves
nothing running here for longer than that.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from qworker.errors import StreamRestartedError
from qworker.jobs.client import Client
from qworker.jobs.job import Job, JobResult

T = TypeVar("T")

# Threads for short store calls (a submit, a result read, a cancel flag): enough for thousands of
# waiting requests, each polling with backoff; more would only queue on the store's connection pool.
STORE_CALL_THREADS = 64
# Backoff of a waiting request's result polls: fast for a short job, gentle for thousands waiting.
MIN_POLL_S = 0.01
MAX_POLL_S = 0.2
READY_PROBE_ID = "qworker-gateway-readiness-probe"


@dataclass(frozen=True)
class StreamText:
    """Text of completion 0 of the job at `prompt_index`, as its worker generated it."""

    prompt_index: int
    text: str


@dataclass(frozen=True)
class StreamEnd:
    prompt_index: int
    result: JobResult


@dataclass(frozen=True)
class StreamFailed:
    prompt_index: int
    message: str


StreamEvent = StreamText | StreamEnd | StreamFailed


class Pool:
    def __init__(self, queue: str | None, results: str | None, stream_results: str | None) -> None:
        self.client = Client(queue=queue, results=results, stream_results=stream_results)
        self._limiter = anyio.CapacityLimiter(STORE_CALL_THREADS)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def submit(self, jobs: list[Job]) -> list[str]:
        return await self.call(self.client.submit_many, jobs)

    async def cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            await self.call(self.client.cancel, job_id)

    async def poll_results(self, job_ids: list[str], found: dict[str, JobResult]) -> None:
        """Read the results not yet in `found` once, adding those that exist."""
        for job_id in job_ids:
            if job_id not in found:
                result = await self.call(self.client.sink.get_result, job_id)
                if result is not None:
                    found[job_id] = result

    async def wait_results(
        self, job_ids: list[str], deadline: float, is_disconnected: Callable[[], Any]
    ) -> dict[str, JobResult] | None:
        """Every job's result, or None when the client went away; TimeoutError past `deadline`
        (time.monotonic())."""
        found: dict[str, JobResult] = {}
        wait_s = MIN_POLL_S
        while True:
            await self.poll_results(job_ids, found)
            if len(found) == len(job_ids):
                return found
            if await is_disconnected():
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no result within the request timeout for {len(job_ids) - len(found)} job(s)"
                )
            await asyncio.sleep(min(wait_s, left))
            wait_s = min(MAX_POLL_S, wait_s * 1.5)

    def open_streams(
        self, job_ids: list[str], timeout_s: float
    ) -> tuple[asyncio.Queue[StreamEvent], threading.Event]:
        """One reader thread per job, all feeding one queue. Set the event to stop them early (a
        thread notices at its next delta or within `timeout_s`)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        stop = threading.Event()
        for index, job_id in enumerate(job_ids):
            thread = threading.Thread(
                target=self._read_stream,
                args=(loop, events, stop, index, job_id, timeout_s),
                name=f"gateway-stream-{job_id[:12]}",
                daemon=True,
            )
            thread.start()
        return events, stop

    def _read_stream(
        self,
        loop: asyncio.AbstractEventLoop,
        events: asyncio.Queue[StreamEvent],
        stop: threading.Event,
        index: int,
        job_id: str,
        timeout_s: float,
    ) -> None:
        def put(event: StreamEvent) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop closed (shutdown)
                stop.set()

        try:
            for text in self.client.stream(job_id, timeout=timeout_s):
                if stop.is_set():
                    return
                put(StreamText(index, text))
            if stop.is_set():
                return
            # The stream ends once the result is stored (a split store: in the final store a
            # moment later, as S3 makes it visible).
            put(StreamEnd(index, self.client.result(job_id, timeout=timeout_s)))
        except StreamRestartedError as exc:
            put(StreamFailed(index, str(exc)))
        except TimeoutError:
            put(StreamFailed(index, f"no output from job {job_id} within {timeout_s:g}s"))
        except Exception as exc:  # the store went away: the client gets an error event
            put(StreamFailed(index, f"reading job {job_id} failed: {type(exc).__name__}: {exc}"))

    def check_ready(self) -> str | None:
        """None when the queue and the result store answer, else what failed (blocking)."""
        try:
            self.client.producer.queue_depth()
        except Exception as exc:
            return f"the queue does not answer: {type(exc).__name__}: {exc}"
        try:
            self.client.sink.has_result(READY_PROBE_ID)
        except Exception as exc:
            return f"the result store does not answer: {type(exc).__name__}: {exc}"
        return None

    def close(self) -> None:
        self.client.close()
