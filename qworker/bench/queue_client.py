"""Queue mode: qworker end to end, through the real queue and result store.

Timestamps are taken on the client side, so the submit round trip, the time on the queue, the
worker's admission and the streaming path are all inside TTFT, ITL and E2EL. Each request is
submitted at its arrival time with `Client.submit`; a thread per request reads
`Client.stream` (a chunk is one non-empty text delta) and then `Client.result`, whose usage
gives the token count and whose timings give the queue wait (started_at - enqueued_at).

By default the bench starts its own `qworker worker` subprocess on a fresh stream, group and
key prefix (so no stale jobs or results are seen) and stops it at the end; with
`spawn_worker=False` it uses the URL as given and the workers already serving it.
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
from pathlib import Path
from typing import Any

from qworker.bench.load import LoadGenerator
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.system import Progress, RunClock, RunLimits, RunResult, new_record, time_out_unsent
from qworker.bench.workload import BenchRequest

LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
# qworker:<option> -> `qworker worker` flag. Chunked prefill and static admission are engine-mode
# variants only: the worker has no switch for them.
WORKER_FLAGS = {
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "num_kv_blocks": "--num-kv-blocks",
    "max_model_len": "--max-model-len",
    "attention_backend": "--attention-backend",
    "max_backlog": "--max-backlog",
    "reserve_blocks_per_seq": "--reserve-blocks-per-seq",
}
# A stream that shows nothing for this long is failed (the worker died or never took it).
DEFAULT_STREAM_STALL_S = 600.0
WARMUP_PROMPT_LEN = 64


def default_redis_url() -> str:
    """The Redis server at 127.0.0.1:6379 when one answers, else the embedded one."""
    import redis

    try:
        redis.Redis.from_url(LOCAL_REDIS_URL, socket_connect_timeout=0.5).ping()
        return LOCAL_REDIS_URL
    except redis.RedisError:
        from qworker.worker.connections import resolve_url

        return resolve_url(None)


def worker_args(label: str, options: dict[str, str], engine_overrides: dict[str, Any]) -> list[str]:
    """`qworker worker` flags for a qworker system spec; options with no worker flag are an error."""
    merged: dict[str, Any] = {k: v for k, v in engine_overrides.items() if k in WORKER_FLAGS}
    for key, value in options.items():
        if key not in WORKER_FLAGS:
            raise ValueError(
                f"system {label!r}: option {key!r} is not available in queue mode "
                f"(the worker takes {sorted(WORKER_FLAGS)})"
            )
        merged[key] = value
    args: list[str] = []
    for key, value in merged.items():
        if value is not None:
            args += [WORKER_FLAGS[key], str(value)]
    return args


class QueueClientSystem:
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
    ) -> None:
        self.label = label
        self.queue_url = queue_url
        self.log_dir = Path(log_dir)
        self.model = model
        self.dtype = dtype
        self.device = device
        self.extra_worker_args = list(extra_worker_args)
        self.spawn_worker = spawn_worker
        self.ready_timeout_s = ready_timeout_s
        self.url: str | None = None
        self.client: Any = None
        self.process: subprocess.Popen[bytes] | None = None
        self.run_tag = uuid.uuid4().hex[:10]
        self._num_runs = 0
        self.startup_s: float | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "qworker",
            "mode": "queue",
            "url": self.url,
            "spawned_worker": self.spawn_worker,
            "worker_args": self.extra_worker_args,
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "startup_s": self.startup_s,
        }

    def prepare(self) -> None:
        from qworker.worker.client import Client

        clock = RunClock()
        if self.spawn_worker:
            base = self.queue_url or default_redis_url()
            name = f"qwbench:{self.run_tag}"
            sep = "&" if "?" in base else "?"
            self.url = f"{base}{sep}stream={name}&group=bench&prefix={name}"
            self._start_worker()
        else:
            if not self.queue_url:
                raise ValueError("queue mode without a spawned worker needs --queue-url")
            self.url = self.queue_url
        self.client = Client(queue=self.url)
        # Warm up (and check the path works) with one short job.
        job_id = self.client.submit(
            self._job(f"{self.run_tag}-warmup", [33] * WARMUP_PROMPT_LEN, 4, 0.0, True)
        )
        result = self.client.result(job_id, timeout=self.ready_timeout_s)
        if result.status.value != "completed":
            raise RuntimeError(f"queue warm-up job ended {result.status.value}: {result.error}")
        self.startup_s = clock.now()

    def _start_worker(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.label)
        log_path = self.log_dir / f"worker-{safe}.log"
        name = f"bench-{self.run_tag}"
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
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if f"worker {name} ready" in log_path.read_text():
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"the bench's worker exited early:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        self._stop_worker()
        raise TimeoutError(f"the bench's worker did not start in {self.ready_timeout_s}s; log: {log_path}")

    def _stop_worker(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # drain: the worker finishes and exits 0
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        spawned = self.process is not None
        self._stop_worker()
        if spawned and self.url is not None:
            self._delete_run_keys()

    def _delete_run_keys(self) -> None:
        """Drop the stream, results and deltas this run created (its own names; nothing else)."""
        from qworker.worker.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url, redis_client

        assert self.url is not None, "no URL to clean"
        parsed = parse_url(self.url, SOURCE_PARAMS | SINK_PARAMS)
        redis = redis_client(parsed.connection_url)
        try:
            keys = list(redis.scan_iter(match=f"qwbench:{self.run_tag}*", count=1000))
            for i in range(0, len(keys), 500):
                redis.delete(*keys[i : i + 500])
        finally:
            redis.close()

    @staticmethod
    def _job(
        job_id: str, prompt_token_ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool
    ) -> dict[str, Any]:
        return {
            "id": job_id,
            "prompt_token_ids": prompt_token_ids,
            "params": {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos},
        }

    def run(
        self,
        requests: Sequence[BenchRequest],
        max_concurrency: int | None,
        limits: RunLimits,
        progress: Progress,
    ) -> RunResult:
        client = self.client
        assert client is not None, "prepare() first"
        self._num_runs += 1
        by_id = {r.request_id: r for r in requests}
        load = LoadGenerator(requests, max_concurrency)
        deadline = limits.run_deadline(requests)
        stall_s = limits.request_timeout_s or DEFAULT_STREAM_STALL_S
        records: list[RequestRecord] = []
        outstanding: dict[str, tuple[RequestRecord, str]] = {}  # request id -> (record, job id)
        lock = threading.Lock()
        finished: queue.Queue[tuple[str, float]] = queue.Queue()
        clock = RunClock()

        def settle(record: RequestRecord, status: RequestStatus, t: float, error: str | None = None) -> bool:
            # Under `lock`: the first of (reader thread, timeout, deadline) to settle a record wins.
            if record.status is not None:
                return False
            record.finish(status, t, error)
            return True

        def read(record: RequestRecord, job_id: str) -> None:
            try:
                for _text in client.stream(job_id, timeout=stall_s):
                    t = clock.now()
                    with lock:
                        if record.status is not None:
                            return
                        record.add_chunk(t, 0)
                result = client.result(job_id, timeout=stall_s)
                t = clock.now()
                status = {
                    "completed": RequestStatus.COMPLETED,
                    "timeout": RequestStatus.TIMEOUT,
                }.get(result.status.value, RequestStatus.FAILED)
                error = f"{result.error.type}: {result.error.message}" if result.error else None
                if status is not RequestStatus.COMPLETED and error is None:
                    error = f"job {result.status.value}"
                with lock:
                    if record.status is not None:
                        return
                    record.num_output_tokens = result.usage.completion_tokens
                    timings = result.timings
                    if timings.started_at is not None and timings.enqueued_at is not None:
                        record.queue_wait_s = timings.started_at - timings.enqueued_at
                    settle(record, status, t, error)
                    finished.put((record.request_id, t))
            except Exception as exc:  # a broken stream fails its request, never the run
                t = clock.now()
                with lock:
                    if settle(record, RequestStatus.FAILED, t, f"{type(exc).__name__}: {exc}"):
                        finished.put((record.request_id, t))

        while True:
            t = clock.now()
            for sent in load.poll(t):
                request = sent.request
                record = new_record(request, sent.send_time)
                records.append(record)
                job_id = f"{self.run_tag}-{self._num_runs}-{request.request_id}"
                job = self._job(
                    job_id,
                    request.prompt_token_ids,
                    request.output_len,
                    request.temperature,
                    request.ignore_eos,
                )
                try:
                    client.submit(job)
                except Exception as exc:
                    with lock:
                        settle(
                            record, RequestStatus.FAILED, clock.now(), f"submit: {type(exc).__name__}: {exc}"
                        )
                    finished.put((record.request_id, clock.now()))
                    continue
                outstanding[record.request_id] = (record, job_id)
                threading.Thread(target=read, args=(record, job_id), daemon=True).start()
            if deadline is not None and t >= deadline:
                break
            if limits.request_timeout_s is not None:
                for record, job_id in list(outstanding.values()):
                    if t - record.arrival_time > limits.request_timeout_s:
                        with lock:
                            if settle(record, RequestStatus.TIMEOUT, t, "exceeded the request timeout"):
                                finished.put((record.request_id, t))
                        client.cancel(job_id)
            if load.is_exhausted and not outstanding:
                break
            next_send = load.next_send_time()
            wake = next_send if next_send is not None else t + 0.5
            if deadline is not None:
                wake = min(wake, deadline)
            try:
                request_id, t_done = finished.get(timeout=max(0.0, wake - clock.now()))
            except queue.Empty:
                continue
            while True:
                outstanding.pop(request_id, None)
                load.on_finished(t_done)
                progress(1)
                try:
                    request_id, t_done = finished.get_nowait()
                except queue.Empty:
                    break

        t = clock.now()
        with lock:
            for record, job_id in outstanding.values():
                if settle(record, RequestStatus.TIMEOUT, t, "still running at the run's time limit"):
                    client.cancel(job_id)
        progress(len(outstanding))
        records.extend(time_out_unsent(load, t, progress))
        assert all(r.request_id in by_id for r in records), "a record for an unknown request"
        return RunResult(
            system=self.label, mode=self.mode, records=records, duration_s=clock.now(), meta={"url": self.url}
        )
