"""The HTTP side of an http-mode system: one streaming `POST /v1/completions` per request, as an
OpenAI client sends it, read from a thread of its own, against any OpenAI-compatible server
(qworker's gateway, `vllm serve`).

Each request sends its prompt as token ids with `stream_options.include_usage`. Timestamps are
taken on the client side. A chunk is one server-sent event with non-empty text (several tokens
may come in one); the usage chunk gives the token count; the request finishes at `data: [DONE]`.
Finish reasons are counted for the run's meta. A cancelled request's connection is closed (the
server sees the disconnect).
"""

from __future__ import annotations

import collections
import json
import queue
import socket
import threading
from typing import Any

import httpx

from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.run import Run
from qworker.bench.stream_events import StreamChunk, StreamDone, apply_events
from qworker.bench.workload import BenchRequest

# Concurrent streams a run may hold open: the client pool's limit (and a spawned gateway's).
MAX_CONNECTIONS = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CompletionsStream:
    """The streaming requests of one server at `base_url`, serving `model_name` (the first model
    its /v1/models lists, unless given)."""

    def __init__(self, base_url: str, model_name: str | None = None) -> None:
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
        self.http = httpx.Client(base_url=base_url, limits=limits, timeout=None)
        if model_name is None:
            models = self.http.get("/v1/models", timeout=30)
            models.raise_for_status()
            model_name = str(models.json()["data"][0]["id"])
        self.model_name = model_name
        self._events: queue.Queue[StreamChunk | StreamDone] = queue.Queue()
        self._responses: dict[str, httpx.Response] = {}
        self._finish_reasons: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def close(self) -> None:
        self.http.close()

    def begin(self) -> None:
        # Fresh per run: a reader still busy with an earlier run's request posts to that run's queue.
        self._events = queue.Queue()
        self._responses = {}
        self._finish_reasons = collections.Counter()

    @property
    def finish_reasons(self) -> dict[str, int]:
        return dict(self._finish_reasons)

    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        body = {
            "model": self.model_name,
            "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len,
            "temperature": request.temperature,
            "ignore_eos": request.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        threading.Thread(target=self._read, args=(run, record, body, self._events), daemon=True).start()

    def advance(self, run: Run, wake: float | None) -> None:
        apply_events(run, self._events, wake)

    def cancel(self, record: RequestRecord) -> None:
        with self._lock:
            response = self._responses.pop(record.request_id, None)
        if response is not None:
            response.close()

    def _read(
        self,
        run: Run,
        record: RequestRecord,
        body: dict[str, Any],
        events: queue.Queue[StreamChunk | StreamDone],
    ) -> None:
        """A reader thread: the request's server-sent events as they come, until [DONE]."""
        num_tokens: int | None = None
        reasons: list[str] = []
        try:
            with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = response.read().decode(errors="replace")[:500]
                    events.put(
                        StreamDone(
                            record, run.now(), RequestStatus.FAILED, f"HTTP {response.status_code}: {text}"
                        )
                    )
                    return
                with self._lock:
                    self._responses[record.request_id] = response
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        events.put(
                            StreamDone(record, run.now(), RequestStatus.FAILED, str(chunk["error"])[:500])
                        )
                        return
                    for choice in chunk.get("choices") or []:
                        if choice.get("text"):
                            events.put(StreamChunk(record, run.now()))
                        if choice.get("finish_reason"):
                            reasons.append(choice["finish_reason"])
                    if chunk.get("usage"):
                        num_tokens = chunk["usage"]["completion_tokens"]
                else:
                    events.put(
                        StreamDone(record, run.now(), RequestStatus.FAILED, "the stream ended before [DONE]")
                    )
                    return
        except Exception as exc:  # a broken stream fails its request, never the run
            if record.status is None:
                events.put(
                    StreamDone(record, run.now(), RequestStatus.FAILED, f"{type(exc).__name__}: {exc}")
                )
            return
        finally:
            with self._lock:
                self._responses.pop(record.request_id, None)
        with self._lock:
            self._finish_reasons.update(reasons)
        events.put(StreamDone(record, run.now(), RequestStatus.COMPLETED, None, num_tokens))
