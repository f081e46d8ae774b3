"""The gateway's side of the pool: submit, wait, stream and cancel through the worker's `Client`
(its producer and result store), from asyncio.

Waiting is asynchronous. Where the live deltas and job notes are in Redis on one server (the
result store, or the streaming side of a split store such as S3 + Redis), a `DeltaHub`
(backends/redis/delta_hub.py, redis.asyncio) reads them: each waiting request or live stream is a
coroutine on a few shared blocking XREADs and one bounded connection pool, never a thread. Results
in that Redis are read with it too; results elsewhere (S3) are read by short calls on the bounded
thread pool below, polled with backoff from a coroutine. Submitting (the queue's producer: Redis,
SQS), tokenizing and the readiness probe are short calls on that bounded pool as well.

A store the hub cannot read (a Redis Cluster, Sentinel) keeps the blocking reader: one thread per
live stream (Client.stream), as before. Either way a stream's reader ends when the job's result is
stored, when no output arrives for the request timeout, or when the request stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from qworker.backends.redis.delta_hub import DeltaHub, open_delta_hub
from qworker.backends.split_sink import SplitSink
from qworker.errors import StreamRestartedError
from qworker.gateway.http_protocol import disconnect_event
from qworker.jobs.client import Client
from qworker.jobs.job import Job, JobResult
from qworker.jobs.text_follower import TextFollower

if TYPE_CHECKING:
    from starlette.requests import Request

T = TypeVar("T")

# Threads for short blocking calls (a submit, an S3 result read, tokenizing); more would only
# queue on the store's connection pool.
STORE_CALL_THREADS = 64
# Backoff of result polls where no delta stream says when a result is stored (S3 alone), and of
# the read just after the done marker (a split store's S3 result may appear a moment later).
MIN_POLL_S = 0.01
MAX_POLL_S = 0.2
# How often a request that waits for whole results checks that its client is still there.
DISCONNECT_POLL_S = 0.2
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


@dataclass
class StreamStop:
    """Stops one request's stream readers: their coroutines at once, a blocking reader's thread
    at its next delta or within the timeout."""

    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    event: threading.Event = field(default_factory=threading.Event)

    def set(self) -> None:
        self.event.set()
        for task in self.tasks:
            task.cancel()

    def is_set(self) -> bool:
        return self.event.is_set()


class Pool:
    def __init__(self, queue: str | None, results: str | None, stream_results: str | None) -> None:
        self.client = Client(queue=queue, results=results, stream_results=stream_results)
        self._limiter = anyio.CapacityLimiter(STORE_CALL_THREADS)
        sink = self.client.sink
        # Where deltas and job notes live; final results too unless the store is split.
        self._stream_store = sink.stream if isinstance(sink, SplitSink) else sink
        self._is_final_in_stream_store = self._stream_store is sink
        # One hub per event loop (its connections belong to the loop that opened them).
        self._hubs: dict[asyncio.AbstractEventLoop, DeltaHub] = {}

    def _hub(self) -> DeltaHub | None:
        """This loop's hub, or None when the store is not one the hub reads."""
        loop = asyncio.get_running_loop()
        hub = self._hubs.get(loop)
        if hub is None:
            hub = open_delta_hub(self._stream_store)
            if hub is None:
                return None
            self._hubs = {k: v for k, v in self._hubs.items() if not k.is_closed()} | {loop: hub}
        return hub

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def submit(self, jobs: list[Job]) -> list[str]:
        return await self.call(self.client.submit_many, jobs)

    async def cancel(self, job_ids: list[str]) -> None:
        hub = self._hub()
        if hub is not None:
            await asyncio.gather(*(hub.request_cancel(job_id) for job_id in job_ids))
            return
        for job_id in job_ids:
            await self.call(self.client.cancel, job_id)

    async def get_result(self, job_id: str) -> JobResult | None:
        hub = self._hub()
        if hub is not None and self._is_final_in_stream_store:
            return await hub.get_result(job_id)
        return await self.call(self.client.sink.get_result, job_id)

    async def result_by(self, job_id: str, deadline: float) -> JobResult:
        """The job's result, polled with backoff until `deadline` (time.monotonic()), then
        TimeoutError."""
        wait_s = MIN_POLL_S
        while True:
            result = await self.get_result(job_id)
            if result is not None:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no result for job {job_id} within the request timeout")
            await asyncio.sleep(min(wait_s, left))
            wait_s = min(MAX_POLL_S, wait_s * 1.5)

    async def _wait_one(self, job_id: str, deadline: float) -> JobResult:
        hub = self._hub()
        if hub is not None:
            # Until the done marker (or a result found while nothing arrives): no polling.
            async for _ in hub.read_deltas(job_id, max(0.001, deadline - time.monotonic())):
                pass
        return await self.result_by(job_id, deadline)

    async def wait_results(
        self, job_ids: list[str], deadline: float, request: Request
    ) -> dict[str, JobResult] | None:
        """Every job's result, or None when the request's client went away; TimeoutError past
        `deadline` (time.monotonic())."""
        waiting = asyncio.ensure_future(asyncio.gather(*(self._wait_one(j, deadline) for j in job_ids)))
        gone = disconnect_event(request.scope)
        lost = asyncio.ensure_future(gone.wait()) if gone is not None else None
        try:
            while True:
                # With the server's disconnect event: one wait; else poll the client.
                timeout = max(0.0, deadline - time.monotonic()) if lost is not None else DISCONNECT_POLL_S
                await asyncio.wait(
                    {waiting, lost} - {None}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if waiting.done():
                    return dict(zip(job_ids, waiting.result(), strict=True))
                if gone.is_set() if gone is not None else await request.is_disconnected():
                    return None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no result within the request timeout for {len(job_ids)} job(s)")
        finally:
            if lost is not None:
                lost.cancel()
            if not waiting.done():
                waiting.cancel()
                with contextlib.suppress(BaseException):
                    await waiting

    def open_streams(
        self, job_ids: list[str], timeout_s: float
    ) -> tuple[asyncio.Queue[StreamEvent], StreamStop]:
        """One reader per job (a coroutine; a thread for a store the hub cannot read), all feeding
        one queue. `StreamStop.set()` stops them."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        stop = StreamStop()
        hub = self._hub()
        for index, job_id in enumerate(job_ids):
            if hub is not None:
                stop.tasks.append(
                    loop.create_task(self._follow_stream(hub, events, index, job_id, timeout_s))
                )
                continue
            thread = threading.Thread(
                target=self._read_stream,
                args=(loop, events, stop.event, index, job_id, timeout_s),
                name=f"gateway-stream-{job_id[:12]}",
                daemon=True,
            )
            thread.start()
        return events, stop

    async def _follow_stream(
        self, hub: DeltaHub, events: asyncio.Queue[StreamEvent], index: int, job_id: str, timeout_s: float
    ) -> None:
        """Client.stream and Client.result, as a coroutine over the hub."""
        try:
            follower = TextFollower(job_id)
            async for delta in hub.read_deltas(job_id, timeout_s):
                text = follower.feed(delta)
                if text:
                    events.put_nowait(StreamText(index, text))
            follower.finish()
            # The stream ends once the result is stored (a split store: in the final store a
            # moment later, as S3 makes it visible).
            events.put_nowait(StreamEnd(index, await self.result_by(job_id, time.monotonic() + timeout_s)))
        except StreamRestartedError as exc:
            events.put_nowait(StreamFailed(index, str(exc)))
        except TimeoutError:
            events.put_nowait(StreamFailed(index, f"no output from job {job_id} within {timeout_s:g}s"))
        except Exception as exc:  # the store went away: the client gets an error event
            events.put_nowait(
                StreamFailed(index, f"reading job {job_id} failed: {type(exc).__name__}: {exc}")
            )

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

    async def aclose(self) -> None:
        hubs, self._hubs = self._hubs, {}
        for hub in hubs.values():
            with contextlib.suppress(Exception):
                await hub.aclose()
        self.client.close()

    def close(self) -> None:
        """Without a running loop (the hubs' connections go with their loops)."""
        self._hubs = {}
        self.client.close()
