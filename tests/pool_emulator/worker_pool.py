"""A pool of real `qworker worker` processes on this machine, sized like a Deployment: set_replicas()
starts processes or stops them with SIGTERM (a drain), poll() follows their readiness (/readyz) and
collects each one's final stats when it exits. With the autoscaler (autoscale.py) it plays a
cluster's part in scenario.py; measure_cold_start() times one worker from process start to
ready and to its first token.

Like a ReplicaSet, a scale-down removes replicas that are not started or not ready first. Among
ready ones it removes the newest (the ReplicaSet's preference for younger pods) or, with
Victim.BUSIEST, the one holding the most jobs at that instant (the consumer group's pending
entries): the hardest case for a drain. A process that cannot start because `max_processes` are
still running (draining ones count) is pending, like a pod on a full node, and starts when one
exits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url, redis_client
from qworker.backends.redis import keys as constants
from qworker.health import READINESS_PATH

QUEUE_URL_ENV = "QWORKER_QUEUE_URL"
# What the worker loop logs as its drain begins.
_DRAIN_LINE = re.compile(r"draining: (\d+) jobs held")


class Victim(str, Enum):
    NEWEST = "newest"
    BUSIEST = "busiest"


class WorkerPhase(str, Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    EXITED = "exited"


@dataclass
class WorkerProcess:
    """One worker process; times are seconds on the pool's clock."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    started_at: float
    ready_at: float | None = None
    terminated_at: float | None = None
    exited_at: float | None = None
    exit_code: int | None = None
    # Its WorkerStats as it wrote them on the way out (None: it exited before its loop ran).
    final_stats: dict[str, Any] | None = None
    # Jobs it held when its drain began, from its log (None: it logged no drain).
    num_held_at_drain: int | None = None

    @property
    def phase(self) -> WorkerPhase:
        if self.exited_at is not None:
            return WorkerPhase.EXITED
        if self.terminated_at is not None:
            return WorkerPhase.DRAINING
        return WorkerPhase.READY if self.ready_at is not None else WorkerPhase.STARTING

    def summary(self) -> dict[str, Any]:
        stats = self.final_stats or {}
        keys = ("num_completed", "num_released", "num_skipped_done", "num_leases_lost", "num_failed")
        return {
            "name": self.name,
            "started_s": self.started_at,
            "ready_s": self.ready_at,
            "cold_start_s": None if self.ready_at is None else self.ready_at - self.started_at,
            "terminated_s": self.terminated_at,
            "exited_s": self.exited_at,
            "exit_code": self.exit_code,
            "num_held_at_drain": self.num_held_at_drain,
            **{key: stats.get(key) for key in keys},
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_ready(port: int, timeout_s: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}{READINESS_PATH}", timeout=timeout_s
        ) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):  # 503 (HTTPError), refused, or timed out
        return False


def spawn_worker(
    queue_url: str,
    model: str,
    name: str,
    worker_args: Sequence[str],
    log_path: Path,
    num_threads: int,
    extra_env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `qworker worker` the way the Deployment does: the queue URL in the environment, the
    endpoints on a port of their own. Returns the process and that port."""
    port = free_port()
    env = {
        **os.environ,
        QUEUE_URL_ENV: queue_url,
        "OMP_NUM_THREADS": str(num_threads),
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "qworker", "worker", "--model", model, "--name", name),
                *("--metrics-port", str(port), *worker_args),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return process, port


class WorkerPool:
    def __init__(
        self,
        queue_url: str,
        model: str,
        worker_args: Sequence[str],
        log_dir: Path,
        *,
        max_processes: int = 2,
        victim: Victim = Victim.NEWEST,
        num_threads: int = 1,
        started_at: float | None = None,
    ) -> None:
        """`queue_url`: a Redis Streams queue whose Redis also holds the results and the workers'
        stats. Times are seconds since `started_at` (time.monotonic(); default now)."""
        if max_processes < 1:
            raise ValueError(f"max_processes must be >= 1, got {max_processes}")
        self.queue_url = queue_url
        self.model = model
        self.worker_args = list(worker_args)
        self.log_dir = log_dir
        self.max_processes = max_processes
        self.victim = victim
        self.num_threads = num_threads
        self._t0 = time.monotonic() if started_at is None else started_at
        parsed = parse_url(queue_url, SOURCE_PARAMS | SINK_PARAMS)
        self._redis = redis_client(parsed.connection_url)
        self._stats_prefix = parsed.params.get("prefix", constants.DEFAULT_RESULT_PREFIX)
        self._stream = parsed.params.get("stream", constants.DEFAULT_STREAM)
        self._group = parsed.params.get("group", constants.DEFAULT_GROUP)
        self._tag = uuid.uuid4().hex[:6]
        self.workers: list[WorkerProcess] = []
        # The replica count asked for (the Deployment's spec.replicas).
        self.replicas = 0

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _in(self, *phases: WorkerPhase) -> list[WorkerProcess]:
        return [w for w in self.workers if w.phase in phases]

    @property
    def num_ready(self) -> int:
        return len(self._in(WorkerPhase.READY))

    @property
    def num_starting(self) -> int:
        return len(self._in(WorkerPhase.STARTING))

    @property
    def num_draining(self) -> int:
        return len(self._in(WorkerPhase.DRAINING))

    @property
    def num_pending(self) -> int:
        return self.replicas - len(self._in(WorkerPhase.STARTING, WorkerPhase.READY))

    @property
    def num_alive(self) -> int:
        return len(self._in(WorkerPhase.STARTING, WorkerPhase.READY, WorkerPhase.DRAINING))

    def set_replicas(self, replicas: int) -> None:
        assert replicas >= 0, f"a replica count is >= 0, got {replicas}"
        self.replicas = replicas
        serving = self._in(WorkerPhase.STARTING, WorkerPhase.READY)
        for worker in self._victims(len(serving) - replicas):
            worker.process.send_signal(signal.SIGTERM)
            worker.terminated_at = self._now()
        self._start_pending()

    def _victims(self, count: int) -> list[WorkerProcess]:
        if count <= 0:
            return []
        starting = sorted(self._in(WorkerPhase.STARTING), key=lambda w: -w.started_at)
        ready = self._in(WorkerPhase.READY)
        if self.victim is Victim.BUSIEST:
            held = self._entries_held()
            ready.sort(key=lambda w: (-held.get(w.name, 0), -w.started_at))
        else:
            ready.sort(key=lambda w: -w.started_at)
        return (starting + ready)[:count]

    def _entries_held(self) -> dict[str, int]:
        """Stream entries each consumer (worker name) holds now, from XPENDING's summary: exact at
        this instant, where the workers' stats reports are up to a stats interval old."""
        import redis as redis_lib

        try:
            summary = self._redis.xpending(self._stream, self._group)
        except redis_lib.ResponseError:  # no stream or group yet
            return {}
        return {_text(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}

    def _start_pending(self) -> None:
        while self.num_pending > 0 and self.num_alive < self.max_processes:
            name = f"pool-{self._tag}-{len(self.workers)}"
            log_path = self.log_dir / f"{name}.log"
            started_at = self._now()
            process, port = spawn_worker(
                self.queue_url, self.model, name, self.worker_args, log_path, self.num_threads
            )
            self.workers.append(WorkerProcess(name, process, port, log_path, started_at))

    def poll(self) -> None:
        """Readiness of starting workers, exits (with final stats), then pending starts."""
        for worker in self._in(WorkerPhase.STARTING):
            if is_ready(worker.port):
                worker.ready_at = self._now()
        for worker in self._in(WorkerPhase.STARTING, WorkerPhase.READY, WorkerPhase.DRAINING):
            code = worker.process.poll()
            if code is None:
                continue
            worker.exited_at = self._now()
            worker.exit_code = code
            # Written as the loop ends; it lives 30 s after the worker's last write.
            raw = self._redis.get(f"{self._stats_prefix}:worker:{worker.name}")
            worker.final_stats = json.loads(raw) if raw is not None else None
            drain = _DRAIN_LINE.search(worker.log_path.read_text(errors="replace"))
            worker.num_held_at_drain = int(drain.group(1)) if drain else None
        self._start_pending()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop every process (SIGTERM, a drain; SIGKILL after `timeout_s`) and collect them."""
        self.set_replicas(0)
        deadline = time.monotonic() + timeout_s
        while self.num_alive and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.1)
        for worker in self._in(WorkerPhase.STARTING, WorkerPhase.READY, WorkerPhase.DRAINING):
            worker.process.kill()
            worker.process.wait()
        self.poll()
        self._redis.close()


@dataclass(frozen=True)
class ColdStart:
    """One worker started with a job already waiting (scale from zero). Seconds from process
    start."""

    ready_s: float
    first_token_s: float
    result_s: float
    details: dict[str, Any] = field(default_factory=dict)


def measure_cold_start(
    queue_url: str,
    model: str,
    worker_args: Sequence[str],
    log_dir: Path,
    *,
    job: dict[str, Any],
    num_threads: int,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
) -> ColdStart:
    """Put `job` on the queue, start one worker and time it: process start -> /readyz 200, and ->
    the job's first token (the engine's clock, in the stored result), and -> its stored result.
    `extra_env`: e.g. QWORKER_CACHE_DIR of an empty folder, for a node's very first start."""
    from qworker.jobs.client import Client

    with Client(queue=queue_url) as client:
        job_id = client.submit(job)
        name = f"cold-{uuid.uuid4().hex[:6]}"
        started_wall = time.time()
        started = time.monotonic()
        process, port = spawn_worker(
            queue_url, model, name, worker_args, log_dir / f"{name}.log", num_threads, extra_env
        )
        try:
            ready_s = None
            while ready_s is None:
                if process.poll() is not None:
                    raise RuntimeError(f"worker exited with {process.returncode}; see {log_dir / name}.log")
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"worker not ready within {timeout_s}s")
                # A probe that gives up early leaves a BrokenPipe traceback in the worker's log.
                if is_ready(port, timeout_s=2.0):
                    ready_s = time.monotonic() - started
                else:
                    time.sleep(0.05)
            result = client.result(job_id, timeout=timeout_s)
            result_s = time.monotonic() - started
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert result.timings.first_token_at is not None, f"job {job_id} ended without a token: {result.status}"
    return ColdStart(
        ready_s=ready_s,
        first_token_s=result.timings.first_token_at - started_wall,
        result_s=result_s,
        details={"status": result.status.value, "usage": result.usage.model_dump(), "worker": name},
    )
