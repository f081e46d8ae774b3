"""HTTP mode: qworker end to end through `qworker gateway`, as an OpenAI client reaches a pool.

The same queue and worker(s) as queue mode (queue_client.py), with a gateway in front: each
request is one streaming `POST /v1/completions` (completions_stream.py), sent at its arrival time
from a thread of its own, as queue mode reads each job from a thread of its own. Timestamps are
taken on the client side, so the HTTP round trip, the gateway's mapping and enqueue, the queue,
the worker and the gateway's delta relay are all inside TTFT, ITL and E2EL. A timed-out request's
connection is closed, so the gateway cancels its job (a disconnect cancels).

With `--mode queue,http` the HTTP system runs in front of the queue system's own worker and
stream (the two measure the same pool, one after the other); alone, it starts a worker as queue
mode does. It starts its own gateway subprocess (`qworker gateway`, open: no API keys) on a free
loopback port, unless `gateway_url` names a running one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from qworker.bench.completions_stream import MAX_CONNECTIONS, CompletionsStream, free_port
from qworker.bench.queue_client import QueueClientSystem
from qworker.bench.records import RequestRecord
from qworker.bench.run import Run, RunClock
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest


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
        self.stream: CompletionsStream | None = None
        self.startup_s: float | None = None

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
        self.stream = CompletionsStream(self.gateway_url)
        self.startup_s = clock.now()

    def _start_gateway(self, queue_url: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.label)
        log_path = self.log_dir / f"gateway-{safe}.log"
        port = free_port()
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
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        self._stop_gateway()
        if not self.shares_pool:
            self.pool.close()

    def begin(self, run: Run) -> None:
        assert self.stream is not None, "prepare() first"
        self.stream.begin()

    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        assert self.stream is not None
        self.stream.submit(run, record, request)

    def advance(self, run: Run, wake: float | None) -> bool:
        assert self.stream is not None
        self.stream.advance(run, wake)
        return True

    def cancel(self, run: Run, record: RequestRecord) -> None:
        assert self.stream is not None
        self.stream.cancel(record)  # the gateway sees the disconnect and cancels the job

    def end(self, run: Run) -> None:
        assert self.stream is not None
        run.meta["url"] = self.pool.url
        run.meta["gateway_url"] = self.gateway_url
        run.meta["finish_reasons"] = self.stream.finish_reasons
