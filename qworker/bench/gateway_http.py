"""HTTP mode: qworker end to end through `qworker gateway`, as an OpenAI client reaches a pool.

The same queue and worker(s) as queue mode (queue_client.py), with a gateway in front: each
request is one streaming `POST /v1/completions` (the prompt as token ids, `stream_options.
include_usage`), sent at its arrival time from a thread of its own, as queue mode reads each job
from a thread of its own. Timestamps are taken on the client side, so the HTTP round trip, the
gateway's mapping and enqueue, the queue, the worker and the gateway's delta relay are all
inside TTFT, ITL and E2EL. A chunk is one server-sent event with non-empty text (several tokens
may come in one, as in queue mode); the usage chunk gives the token count; the request finishes
at `data: [DONE]`. Finish reasons are counted in the run's meta. A timed-out request's
connection is closed, so the gateway cancels its job (a disconnect cancels).

With `--mode queue,http` the HTTP system runs in front of the queue system's own worker and
stream (the two measure the same pool, one after the other); alone, it starts a worker as queue
mode does. It starts its own gateway subprocess (`qworker gateway`, open: no API keys) on a free
loopback port, unless `gateway_url` names a running one.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from qworker.bench.queue_client import QueueClientSystem, _Chunk, _Done, apply_events
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.run import Run, RunClock
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest

# Concurrent streams a run may hold open: the client pool and the spawned gateway's limits.
MAX_CONNECTIONS = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayHttpSystem(System):
    mode = "http"

    def __init__(
        self,
        label: str,
        pool: QueueClientSystem,
        log_dir: Path,
        *,
        shares_pool: bool,
        gateway_url: str | None = None,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.label = label
        # The queue system whose worker and URL this one uses; prepared and closed here unless
        # it is a system of the run itself (shares_pool).
        self.pool = pool
        self.shares_pool = shares_pool
        self.log_dir = Path(log_dir)
        self.gateway_url = gateway_url
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.http: httpx.Client | None = None
        self.model_name: str | None = None
        self.startup_s: float | None = None
        self._events: queue.Queue[_Chunk | _Done] = queue.Queue()
        self._responses: dict[str, httpx.Response] = {}
        self._finish_reasons: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "qworker",
            "mode": "http",
            "url": self.pool.url,
            "gateway_url": self.gateway_url,
            "spawned_gateway": self.process is not None,
            "shares_queue_system": self.shares_pool,
            "worker_args": self.pool.extra_worker_args,
            "model": self.pool.model,
            "startup_s": self.startup_s,
        }

    def prepare(self) -> None:
        clock = RunClock()
        if not self.shares_pool:
            self.pool.prepare()
        assert self.pool.url is not None, "the queue system is prepared first"
        if self.gateway_url is None:
            self._start_gateway(self.pool.url)
        assert self.gateway_url is not None
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
        self.http = httpx.Client(base_url=self.gateway_url, limits=limits, timeout=None)
        models = self.http.get("/v1/models", timeout=30)
        models.raise_for_status()
        self.model_name = models.json()["data"][0]["id"]
        self.startup_s = clock.now()

    def _start_gateway(self, queue_url: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.label)
        log_path = self.log_dir / f"gateway-{safe}.log"
        port = _free_port()
        command = [sys.executable, "-m", "qworker.cli", "gateway", "--queue", queue_url]
        command += ["--port", str(port), "--model", self.pool.model, "--log-level", "WARNING"]
        command += [
            "--max-inflight-requests",
            str(MAX_CONNECTIONS),
            "--limit-concurrency",
            str(MAX_CONNECTIONS),
        ]
        env = {k: v for k, v in os.environ.items() if k != "QWORKER_API_KEYS"}  # open: no keys
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"}
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the bench's gateway exited early:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    self.gateway_url = url
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self._stop_gateway()
        raise TimeoutError(f"the bench's gateway did not start in {self.ready_timeout_s}s; log: {log_path}")

    def _stop_gateway(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None
        self._stop_gateway()
        if not self.shares_pool:
            self.pool.close()

    def begin(self, run: Run) -> None:
        assert self.http is not None, "prepare() first"
        # Fresh per run: a reader still busy with an earlier run's request posts to that run's queue.
        self._events = queue.Queue()
        self._responses = {}
        self._finish_reasons = collections.Counter()

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

    def advance(self, run: Run, wake: float | None) -> bool:
        apply_events(run, self._events, wake)
        return True

    def cancel(self, run: Run, record: RequestRecord) -> None:
        with self._lock:
            response = self._responses.pop(record.request_id, None)
        if response is not None:
            response.close()  # the gateway sees the disconnect and cancels the job

    def end(self, run: Run) -> None:
        run.meta["url"] = self.pool.url
        run.meta["gateway_url"] = self.gateway_url
        run.meta["finish_reasons"] = dict(self._finish_reasons)

    def _read(
        self, run: Run, record: RequestRecord, body: dict[str, Any], events: queue.Queue[_Chunk | _Done]
    ) -> None:
        """A reader thread: the request's server-sent events as they come, until [DONE]."""
        assert self.http is not None
        num_tokens: int | None = None
        reasons: list[str] = []
        try:
            with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = response.read().decode(errors="replace")[:500]
                    events.put(
                        _Done(record, run.now(), RequestStatus.FAILED, f"HTTP {response.status_code}: {text}")
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
                        events.put(_Done(record, run.now(), RequestStatus.FAILED, str(chunk["error"])[:500]))
                        return
                    for choice in chunk.get("choices") or []:
                        if choice.get("text"):
                            events.put(_Chunk(record, run.now()))
                        if choice.get("finish_reason"):
                            reasons.append(choice["finish_reason"])
                    if chunk.get("usage"):
                        num_tokens = chunk["usage"]["completion_tokens"]
                else:
                    events.put(
                        _Done(record, run.now(), RequestStatus.FAILED, "the stream ended before [DONE]")
                    )
                    return
        except Exception as exc:  # a broken stream fails its request, never the run
            if record.status is None:
                events.put(_Done(record, run.now(), RequestStatus.FAILED, f"{type(exc).__name__}: {exc}"))
            return
        finally:
            with self._lock:
                self._responses.pop(record.request_id, None)
        with self._lock:
            self._finish_reasons.update(reasons)
        events.put(_Done(record, run.now(), RequestStatus.COMPLETED, None, num_tokens))
