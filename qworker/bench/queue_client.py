"""Queue mode: qworker end to end, through the real queue and result store.

Timestamps are taken on the client side, so the submit round trip, the time on the queue, the
worker's admission and the streaming path are all inside TTFT, ITL and E2EL. Each request is
submitted at its arrival time with `Client.submit`; a thread per request reads
`Client.stream` (a chunk is one non-empty text delta) and then `Client.result`, whose usage
gives the token count and whose timings give the queue wait (started_at - enqueued_at). The
reader threads only post what they saw (with its time) to the run loop's thread, which owns the
records. With `stream=False` one thread reads the results in submit order instead, as a bulk
client does: lighter on a process that also runs the worker, but with no TTFT or ITL, and finish
times are when the client read each result.

By default the bench starts its own `qworker worker` subprocess on a fresh stream, group and
key prefix (so no stale jobs or results are seen) and stops it at the end; with
`spawn_worker=False` it uses the URL as given and the workers already serving it.

A pool (`num_workers` > 1, `qworker bench --workers N`) is N such processes on the same queue,
each with `worker_threads` OpenMP threads, behind a private `redis-server` the system starts on a
free loopback port unless a URL is given. A system spec's queue options (`affinity_lanes=16`,
`steal_after_s=0.5`: QUEUE_URL_OPTIONS) go on the queue URL. Each record keeps what its result
says about the prefix cache (cached prompt tokens) and which worker ran it (pool_stats.py).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.registry import (
    BenchSettings,
    SystemSpec,
    SystemSpecError,
    engine_config_for,
    parse_field_options,
)
from qworker.bench.run import Run, RunClock
from qworker.bench.stream_events import StreamChunk, StreamDone, apply_events
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest
from qworker.cli_options import config_option_list, config_to_args
from qworker.worker.settings import WorkerSettings

LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
# Options of a qworker system spec that belong on the queue URL (docs/queues.md, "Affinity lanes"),
# each with its type; `qworker:affinity_lanes=16` is a pool reading 16 lanes.
QUEUE_URL_OPTIONS: dict[str, type] = {"affinity_lanes": int, "steal_after_s": float}
# A stream that shows nothing for this long is failed (the worker died or never took it).
DEFAULT_STREAM_STALL_S = 600.0
_RESULT_STATUSES = {"completed": RequestStatus.COMPLETED, "timeout": RequestStatus.TIMEOUT}


def default_redis_url() -> str:
    """The Redis server at 127.0.0.1:6379 when one answers, else the embedded one."""
    import redis

    try:
        redis.Redis.from_url(LOCAL_REDIS_URL, socket_connect_timeout=0.5).ping()
        return LOCAL_REDIS_URL
    except redis.RedisError:
        from qworker.backends.connections import resolve_url

        return resolve_url(None)


def queue_url_options(spec: SystemSpec) -> dict[str, str]:
    """The spec's options that go on the queue URL (QUEUE_URL_OPTIONS), checked."""
    options = {k: v for k, v in spec.options.items() if k in QUEUE_URL_OPTIONS}
    for key, value in options.items():
        try:
            number = QUEUE_URL_OPTIONS[key](value)
        except ValueError:
            raise SystemSpecError(f"system {spec.label!r}: {key}={value!r} is not a number") from None
        if number < (1 if key == "affinity_lanes" else 0):
            raise SystemSpecError(f"system {spec.label!r}: {key}={value!r} is out of range")
    return options


def worker_args(spec: SystemSpec, settings: BenchSettings) -> list[str]:
    """`qworker worker` flags for a qworker system spec: its engine options and any WorkerSettings
    fields it names (max_backlog=4, ...). Static admission is an engine-mode variant only: the
    worker has no switch for it. Model, dtype and device are passed by the system itself; queue
    URL options (affinity_lanes=16) by the URL."""
    worker_fields = {o.field_name for o in config_option_list(WorkerSettings, exclude=("name",))}
    worker_options = {k: v for k, v in spec.options.items() if k in worker_fields}
    engine_spec = replace(
        spec,
        options={
            k: v for k, v in spec.options.items() if k not in worker_fields and k not in QUEUE_URL_OPTIONS
        },
    )
    config, static_batch_size = engine_config_for(engine_spec, settings)
    if static_batch_size is not None:
        raise SystemSpecError(f"system {spec.label!r}: static admission is not available in queue mode")
    worker = WorkerSettings(name="bench", **parse_field_options(spec, WorkerSettings, worker_options))
    return config_to_args(config, exclude=("model", "dtype", "device")) + config_to_args(
        worker, only=worker_options
    )


class QueueClientSystem(System):
    mode = "queue"

    def __init__(
        self,
        label: str,
        queue_url: str | None,
        log_dir: Path,
        model: str,
        dtype: str,
        device: str,
        extra_worker_args: Sequence[str] = (),
        spawn_worker: bool = True,
        ready_timeout_s: float = 900.0,
        stream: bool = True,
        num_workers: int = 1,
        worker_threads: int | None = None,
        url_options: dict[str, str] | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.label = label
        self.queue_url = queue_url
        self.log_dir = Path(log_dir)
        self.model = model
        self.dtype = dtype
        self.device = device
        self.extra_worker_args = list(extra_worker_args)
        self.spawn_worker = spawn_worker
        self.ready_timeout_s = ready_timeout_s
        self.stream = stream
        self.num_workers = num_workers
        self.worker_threads = worker_threads
        self.url_options = dict(url_options or {})
        self.url: str | None = None
        self.client: Any = None
        self.processes: list[subprocess.Popen[bytes]] = []
        self.redis_server: Any = None  # the private redis-server of a pool, when it started one
        self._redis_dir: Any = None
        self.run_tag = uuid.uuid4().hex[:10]
        self._num_runs = 0
        self.startup_s: float | None = None
        self._events: queue.Queue[StreamChunk | StreamDone] = queue.Queue()
        self._job_ids: dict[str, str] = {}  # request id -> job id, this run
        self._collector: queue.Queue[tuple[RequestRecord, str] | None] | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "qworker",
            "mode": "queue",
            "url": self.url,
            "spawned_worker": self.spawn_worker,
            "worker_args": self.extra_worker_args,
            "stream": self.stream,
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "startup_s": self.startup_s,
            "num_workers": self.num_workers,
            "worker_threads": self.worker_threads,
            "url_options": self.url_options,
            "private_redis": self.redis_server is not None,
        }

    def prepare(self) -> None:
        from qworker.jobs.client import Client

        clock = RunClock()
        if self.spawn_worker:
            base = self.queue_url or (self._start_redis() if self.num_workers > 1 else default_redis_url())
            name = f"qwbench:{self.run_tag}"
            sep = "&" if "?" in base else "?"
            extra = "".join(f"&{k}={v}" for k, v in self.url_options.items())
            self.url = f"{base}{sep}stream={name}&group=bench&prefix={name}{extra}"
            self._start_worker()
        else:
            if not self.queue_url:
                raise ValueError("queue mode without a spawned worker needs --queue-url")
            if self.url_options:
                raise ValueError(
                    f"{self.label}: {sorted(self.url_options)} go on the queue URL of the workers "
                    "already serving it (--queue-url), not on a system spec"
                )
            self.url = self.queue_url
        self.client = Client(queue=self.url)
        self.startup_s = clock.now()

    def _start_redis(self) -> str:
        """A private redis-server on a free loopback port, for this pool alone (no AOF)."""
        import tempfile

        from qworker.backends.redis.server import RedisServer

        self._redis_dir = tempfile.TemporaryDirectory(prefix="qwbench-redis-")
        self.redis_server = RedisServer(Path(self._redis_dir.name), appendonly=False).start()
        return str(self.redis_server.url)

    def _stop_redis(self) -> None:
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None
        if self._redis_dir is not None:
            self._redis_dir.cleanup()
            self._redis_dir = None

    def _start_worker(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.label)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.worker_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.worker_threads)
        started: list[tuple[str, Path]] = []
        for i in range(self.num_workers):
            suffix = "" if self.num_workers == 1 else f"-{i}"
            name = f"bench-{self.run_tag}{suffix}"
            log_path = self.log_dir / f"worker-{safe}{suffix}.log"
            self._spawn(name, log_path, env)
            started.append((name, log_path))
        deadline = time.monotonic() + self.ready_timeout_s
        for (name, log_path), process in zip(started, self.processes, strict=True):
            while f"worker {name} ready" not in log_path.read_text():
                if process.poll() is not None:
                    self._stop_worker()
                    raise RuntimeError(f"the bench's worker exited early:\n{log_path.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    self._stop_worker()
                    raise TimeoutError(
                        f"the bench's worker did not start in {self.ready_timeout_s}s; log: {log_path}"
                    )
                time.sleep(0.2)

    def _spawn(self, name: str, log_path: Path, env: dict[str, str]) -> None:
        command = [
            sys.executable,
            "-m",
            "qworker.cli",
            "worker",
            "--queue",
            str(self.url),
            "--model",
            self.model,
            "--dtype",
            self.dtype,
            "--device",
            self.device,
            "--name",
            name,
            *self.extra_worker_args,
        ]
        with open(log_path, "w") as log:
            self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))

    def _stop_worker(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # drain: the worker finishes and exits 0
        for process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        spawned = bool(self.processes)
        self._stop_worker()
        if self.redis_server is not None:
            self._stop_redis()  # its keys go with it
        elif spawned and self.url is not None:
            self._delete_run_keys()

    def _delete_run_keys(self) -> None:
        """Drop the stream, results and deltas this run created (its own names; nothing else)."""
        from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url, redis_client

        assert self.url is not None, "no URL to clean"
        parsed = parse_url(self.url, SOURCE_PARAMS | SINK_PARAMS)
        redis = redis_client(parsed.connection_url)
        try:
            keys = list(redis.scan_iter(match=f"qwbench:{self.run_tag}*", count=1000))
            for i in range(0, len(keys), 500):
                redis.delete(*keys[i : i + 500])
        finally:
            redis.close()

    def begin(self, run: Run) -> None:
        assert self.client is not None, "prepare() first"
        self._num_runs += 1
        # Fresh per run: a reader still busy with an earlier run's job posts to that run's queue.
        self._events = queue.Queue()
        self._job_ids.clear()
        if not self.stream:
            self._collector = queue.Queue()
            threading.Thread(
                target=self._collect, args=(run, self._collector, self._events), daemon=True
            ).start()

    def submit(self, run: Run, record: RequestRecord, request: BenchRequest) -> None:
        job_id = f"{self.run_tag}-{self._num_runs}-{request.request_id}"
        job = {
            "id": job_id,
            "prompt_token_ids": request.prompt_token_ids,
            "params": {
                "max_tokens": request.output_len,
                "temperature": request.temperature,
                "ignore_eos": request.ignore_eos,
            },
        }
        try:
            self.client.submit(job)
        except Exception as exc:
            run.finish(record, RequestStatus.FAILED, run.now(), f"submit: {type(exc).__name__}: {exc}")
            return
        self._job_ids[record.request_id] = job_id
        if self._collector is not None:
            self._collector.put((record, job_id))
        else:
            threading.Thread(target=self._read, args=(run, record, job_id, self._events), daemon=True).start()

    def advance(self, run: Run, wake: float | None) -> bool:
        apply_events(run, self._events, wake)
        return True

    def cancel(self, run: Run, record: RequestRecord) -> None:
        job_id = self._job_ids.get(record.request_id)
        if job_id is not None:
            self.client.cancel(job_id)

    def end(self, run: Run) -> None:
        if self._collector is not None:
            self._collector.put(None)
            self._collector = None
        run.meta["url"] = self.url

    def _stall_s(self, run: Run) -> float:
        return run.limits.request_timeout_s or DEFAULT_STREAM_STALL_S

    def _result_event(self, run: Run, record: RequestRecord, job_id: str) -> StreamDone:
        """Wait for the job's stored result; any error fails its request, never the run."""
        try:
            result = self.client.result(job_id, timeout=self._stall_s(run))
        except Exception as exc:
            return StreamDone(record, run.now(), RequestStatus.FAILED, f"{type(exc).__name__}: {exc}")
        t = run.now()
        status = _RESULT_STATUSES.get(result.status.value, RequestStatus.FAILED)
        error = f"{result.error.type}: {result.error.message}" if result.error else None
        if status is not RequestStatus.COMPLETED and error is None:
            error = f"job {result.status.value}"
        timings = result.timings
        queue_wait_s = None
        if timings.started_at is not None and timings.enqueued_at is not None:
            queue_wait_s = timings.started_at - timings.enqueued_at
        return StreamDone(
            record,
            t,
            status,
            error,
            result.usage.completion_tokens,
            queue_wait_s,
            result.usage.prompt_tokens_details.cached_tokens,
            result.worker,
        )

    def _read(
        self, run: Run, record: RequestRecord, job_id: str, events: queue.Queue[StreamChunk | StreamDone]
    ) -> None:
        """A reader thread: the job's deltas as they come, then its result."""
        try:
            for _text in self.client.stream(job_id, timeout=self._stall_s(run)):
                events.put(StreamChunk(record, run.now()))
                if record.status is not None:
                    return  # timed out: the job was cancelled
        except Exception as exc:  # a broken stream fails its request, never the run
            events.put(StreamDone(record, run.now(), RequestStatus.FAILED, f"{type(exc).__name__}: {exc}"))
            return
        events.put(self._result_event(run, record, job_id))

    def _collect(
        self,
        run: Run,
        jobs: queue.Queue[tuple[RequestRecord, str] | None],
        events: queue.Queue[StreamChunk | StreamDone],
    ) -> None:
        """The results-only reader: each job's result in submit order, until the run ends (None)."""
        while (item := jobs.get()) is not None:
            record, job_id = item
            if record.status is None:
                events.put(self._result_event(run, record, job_id))
