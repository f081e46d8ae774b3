"""One generation request, end to end: body -> jobs (mapping) -> admission (backpressure) ->
enqueue -> wait or stream -> response. Whatever way the request ends early (the client goes away,
the wait limit passes, the stream fails), its unfinished jobs are cancelled, so no worker keeps
computing, or holding KV blocks, for nobody."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from qworker.gateway.errors import GatewayError
from qworker.gateway.http_protocol import disconnect_event
from qworker.gateway.mapping import prepare
from qworker.gateway.pool import StreamEvent
from qworker.gateway.responses import response_body
from qworker.gateway.state import GatewayState, check_model, gateway_state
from qworker.gateway.streaming import stream_events
from qworker.openai.rows import Endpoint

logger = logging.getLogger(__name__)

# nginx's code for a client that closed the request before the answer (nobody reads it).
CLIENT_CLOSED_REQUEST = 499
# How often a request waiting for its first stream event looks for a disconnect.
DISCONNECT_POLL_S = 0.25


class CancellingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client's disconnect (Starlette does only
    for ASGI servers older than spec 2.4, and otherwise notices at the next write) and always
    closes its iterator, so that the iterator's cleanup (cancelling the jobs) runs at once.
    `on_close` runs last, whether or not the iterator ever started."""

    def __init__(self, content: Any, on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        iterator: Any = self.body_iterator
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):  # the client is gone
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                group.start_soon(watch_disconnect)
        finally:
            with anyio.CancelScope(shield=True):
                await iterator.aclose()
                await self.on_close()


async def _cancel(state: GatewayState, job_ids: list[str], reason: str) -> None:
    try:
        await state.pool.cancel(job_ids)
    except Exception:  # the store is away: the job's TTL (the request timeout) still ends it
        logger.warning("cancelling %d job(s) failed", len(job_ids), exc_info=True)
        return
    state.metrics.cancelled_jobs.labels(reason).inc(len(job_ids))


async def _first_event(
    events: asyncio.Queue[StreamEvent], deadline: float, request: Request
) -> StreamEvent | None:
    """The first event of the request's streams: None when the client went away; TimeoutError
    past the deadline (no worker took the job in time)."""
    gone = disconnect_event(request.scope)
    if gone is not None:
        first = asyncio.ensure_future(events.get())
        lost = asyncio.ensure_future(gone.wait())
        try:
            left = max(0.0, deadline - time.monotonic())
            await asyncio.wait({first, lost}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (first, lost):
                task.cancel()
        if first.done() and not first.cancelled():
            return first.result()
        if gone.is_set():
            return None
        raise TimeoutError
    # Another server: poll.
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            with anyio.fail_after(min(DISCONNECT_POLL_S, left)):
                return await events.get()
        except TimeoutError:
            if await request.is_disconnected():
                return None


async def serve_generation(request: Request, body: dict[str, Any], endpoint: Endpoint) -> Response:
    state = gateway_state(request)
    check_model(state, body.get("model"))
    tokenizer = await state.pool.call(state.tokenizer)
    # Tokenizing a long prompt takes milliseconds: off the event loop.
    prepared = await state.pool.call(prepare, body, endpoint, state.settings, tokenizer)
    try:
        admission = state.gate.admit(prepared.num_blocks)
    except GatewayError as exc:
        state.metrics.rejected.labels(exc.code or "refused").inc()
        raise
    state.metrics.inflight_requests.inc()
    is_released_here = True
    try:
        try:
            job_ids = await state.pool.submit(prepared.jobs)
        except Exception as exc:  # the queue is away: the client may retry, nothing was enqueued
            logger.warning("enqueueing failed", exc_info=True)
            raise GatewayError(
                503, f"the queue did not take the job: {type(exc).__name__}", code="queue_unavailable"
            ) from None
        enqueued = time.monotonic()
        deadline = enqueued + state.settings.request_timeout_s
        if not prepared.stream:
            try:
                results = await state.pool.wait_results(job_ids, deadline, request)
            except TimeoutError:
                await _cancel(state, job_ids, "timeout")
                raise GatewayError(
                    504,
                    f"no result within {state.settings.request_timeout_s:g}s (no worker took the job, or it "
                    "ran too long); the job was cancelled",
                    code="timeout",
                ) from None
            except Exception as exc:  # the result store is away
                logger.warning("reading results failed", exc_info=True)
                await _cancel(state, job_ids, "store_error")
                raise GatewayError(
                    503, f"the result store did not answer: {type(exc).__name__}", code="store_unavailable"
                ) from None
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await _cancel(state, job_ids, "disconnect")
                raise
            if results is None:
                await _cancel(state, job_ids, "disconnect")
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            state.metrics.enqueue_to_first_token.observe(time.monotonic() - enqueued)
            return JSONResponse(response_body(prepared, results, tokenizer))
        events, stop = state.pool.open_streams(job_ids, state.settings.request_timeout_s)
        try:
            first = await _first_event(events, deadline, request)
        except TimeoutError:
            stop.set()
            await _cancel(state, job_ids, "timeout")
            raise GatewayError(
                504,
                f"no output within {state.settings.request_timeout_s:g}s; the job was cancelled",
                code="timeout",
            ) from None
        except BaseException:
            stop.set()
            with anyio.CancelScope(shield=True):
                await _cancel(state, job_ids, "disconnect")
            raise
        if first is None:
            stop.set()
            await _cancel(state, job_ids, "disconnect")
            return Response(status_code=CLIENT_CLOSED_REQUEST)

        def on_first_token(prompt_index: int) -> None:
            state.metrics.enqueue_to_first_token.observe(time.monotonic() - enqueued)

        is_started = False

        async def body_iterator() -> Any:
            nonlocal is_started
            is_started = True
            state.metrics.inflight_streams.inc()
            try:
                async for chunk in stream_events(
                    prepared,
                    events,
                    first,
                    stop,
                    deadline=deadline,
                    tokenizer=tokenizer,
                    cancel=lambda ids: _cancel(state, ids, "disconnect"),
                    on_first_token=on_first_token,
                ):
                    yield chunk
            finally:
                state.metrics.inflight_streams.dec()

        async def on_close() -> None:
            stop.set()
            state.metrics.inflight_requests.dec()
            admission.release()
            if not is_started:
                # Cut before its first chunk: stream_events, which cancels what it leaves
                # unfinished, never ran.
                await _cancel(state, job_ids, "disconnect")

        is_released_here = False
        return CancellingStreamingResponse(
            body_iterator(),
            on_close,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    finally:
        if is_released_here:
            state.metrics.inflight_requests.dec()
            admission.release()
