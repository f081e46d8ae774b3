"""Server-sent events in OpenAI's chunk format, read from the jobs' delta streams.

    data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    ...
    data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    data: {"object": "chat.completion.chunk", "choices": [], "usage": {...}}      (include_usage)
    data: [DONE]

What is streamed live is completion 0's text of each job, as its worker generates it (Client.stream
drops what an attempt that was superseded streamed, so the text never repeats). When a job's result
is stored, the rest of its text is sent: the part the live stream had not carried (all of it from a
store without deltas, e.g. S3 results without --stream-results), the other completions of n > 1,
and logprobs, which the delta stream does not carry (choices that ask for logprobs come whole, at
the end). The assembled text of each choice is therefore always its stored result's text. Should a
new attempt diverge from text already sent, the stream ends with an error event instead.

A chat row read for reasoning or tool calls (openai/chat_output.py) streams OpenAI's deltas for
them instead of raw text: `reasoning_content` (and `reasoning`), `content`, and `tool_calls`
(index, id, type and name first, then the arguments), computed from the same text by the same
code as the stored answer, so that they join into its message.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from qworker.gateway.errors import GatewayError
from qworker.gateway.mapping import PreparedRequest
from qworker.gateway.pool import StreamEnd, StreamEvent, StreamFailed, StreamStop, StreamText
from qworker.gateway.responses import job_body
from qworker.gateway.tokenizer import GatewayTokenizer
from qworker.openai.bodies import call_id_seed
from qworker.openai.chat_output import MessageStream
from qworker.openai.format import ChatChoice, TextChoice, Usage
from qworker.openai.rows import Endpoint

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class ChunkWriter:
    """Builds the chunks of one request."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared
        self.is_chat = prepared.endpoint is Endpoint.CHAT
        self.id = f"{'chatcmpl' if self.is_chat else 'cmpl'}-{prepared.request_id}"

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": self.prepared.created,
            "model": self.prepared.rows[0].model,
            "choices": choices,
        }
        if self.prepared.include_usage:
            data["usage"] = usage
        return sse(data)

    def choice(
        self,
        index: int,
        text: str | None,
        *,
        role: bool = False,
        logprobs: Any = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        if self.is_chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def delta_choice(index: int, delta: dict[str, Any], logprobs: Any = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}


def error_event(error: GatewayError) -> bytes:
    """An error after the 200 went out: the SDK raises APIError on a chunk with `error`."""
    return sse(error.body())


async def stream_events(
    prepared: PreparedRequest,
    events: asyncio.Queue[StreamEvent],
    first: StreamEvent,
    stop: StreamStop,
    *,
    deadline: float,
    tokenizer: GatewayTokenizer | None,
    cancel: Callable[[list[str]], Awaitable[None]],
    on_first_token: Callable[[int], None],
) -> AsyncIterator[bytes]:
    writer = ChunkWriter(prepared)
    n = prepared.n
    num_jobs = len(prepared.jobs)
    streamed = [""] * num_jobs
    ended: set[int] = set()
    usages: list[Usage] = []
    is_live = [row.num_top_logprobs is None for row in prepared.rows]
    # Rows read for reasoning or tool calls: one MessageStream per choice.
    parsers = [
        [MessageStream(row.output_parsing, call_id_seed(row, c)) for c in range(n)]
        if writer.is_chat and row.output_parsing.is_active
        else None
        for row in prepared.rows
    ]
    try:
        opening = []
        for p, row in enumerate(prepared.rows):
            echo = (
                (prepared.echo_texts[p] or (row.prompt if isinstance(row.prompt, str) else ""))
                if row.echo
                else None
            )
            for c in range(n):
                if writer.is_chat:
                    opening.append(writer.choice(p * n + c, "", role=True))
                elif echo:
                    opening.append(writer.choice(p * n + c, echo))
        if opening:
            yield writer.chunk(opening)
        event: StreamEvent | None = first
        while len(ended) < num_jobs:
            if event is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    yield error_event(
                        GatewayError(504, "the request timeout passed; the job was cancelled", code="timeout")
                    )
                    return
                try:
                    with anyio.fail_after(left):
                        event = await events.get()
                except TimeoutError:
                    continue
            if isinstance(event, StreamText) and event.prompt_index not in ended:
                p = event.prompt_index
                if not streamed[p]:
                    on_first_token(p)
                streamed[p] += event.text
                message_streams = parsers[p]
                if is_live[p] and event.text and message_streams is not None:
                    for delta in message_streams[0].feed(event.text):
                        yield writer.chunk([delta_choice(p * n, delta)])
                elif is_live[p] and event.text:
                    yield writer.chunk([writer.choice(p * n, event.text)])
            elif isinstance(event, StreamFailed):
                yield error_event(GatewayError(502, event.message, code="stream_failed"))
                return
            elif isinstance(event, StreamEnd):
                p = event.prompt_index
                try:
                    body, generation = job_body(prepared, p, event.result, tokenizer)
                except GatewayError as exc:
                    yield error_event(exc)
                    return
                if not streamed[p]:
                    on_first_token(p)
                choices: list[ChatChoice | TextChoice] = list(body.choices)
                for choice, completion in zip(choices, generation.completions, strict=True):
                    rest = completion.text
                    if choice.index == 0 and is_live[p]:
                        if not completion.text.startswith(streamed[p]):
                            yield error_event(
                                GatewayError(
                                    502,
                                    "the job's stored text differs from what was streamed",
                                    code="stream_failed",
                                )
                            )
                            return
                        rest = completion.text[len(streamed[p]) :]
                    logprobs = choice.logprobs.model_dump() if choice.logprobs is not None else None
                    index = p * n + choice.index
                    message_streams = parsers[p]
                    if message_streams is not None:
                        message_stream = message_streams[choice.index]
                        deltas = message_stream.feed(rest) + message_stream.finish()
                        if logprobs is not None and not deltas:
                            deltas = [{}]
                        for k, delta in enumerate(deltas):
                            yield writer.chunk([delta_choice(index, delta, logprobs if k == 0 else None)])
                    elif rest or logprobs is not None:
                        yield writer.chunk([writer.choice(index, rest, logprobs=logprobs)])
                    yield writer.chunk(
                        [
                            writer.choice(
                                index, None if writer.is_chat else "", finish_reason=choice.finish_reason
                            )
                        ]
                    )
                usages.append(body.usage)
                ended.add(p)
            event = None
        if prepared.include_usage:
            yield writer.chunk([], Usage.total(usages).model_dump())
        yield DONE
    finally:
        stop.set()
        unfinished = [job.id for p, job in enumerate(prepared.jobs) if p not in ended]
        if unfinished:
            # The client went away (or the stream failed): free the workers' KV blocks now. Shielded:
            # this runs while the response task is being cancelled.
            with anyio.CancelScope(shield=True):
                await cancel(unfinished)
