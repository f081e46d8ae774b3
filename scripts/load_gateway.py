"""Load through the gateway: N concurrent streaming chat requests through one `qworker gateway` to
several workers on a private Redis (a redis-server this script starts). Every stream must complete
and its text equal its stored result; the gateway's peak RSS, peak thread count and CPU time are
reported (from /proc), and the TTFT the gateway adds: the client's first content chunk against
the first token's time in the job's stored result (the worker's clock; the same machine).

    .venv/bin/python scripts/load_gateway.py --num-requests 2000 --num-workers 2 --max-tokens 16

`--engine fake` (the default): workers run the real worker loop on the scripted FakeEngine (no
model, one token per request per step, --step-ms between steps), so that the gateway is what is
measured; `--engine model` runs `qworker worker --model MODEL` instead. The open-files limit is
raised to its hard limit (each stream holds a client socket and a gateway socket).

Not part of `make test`: it runs a minute or more and wants the machine to itself. Prints one JSON
object (also written to --out when given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from qworker.jobs.client import Client
from qworker.openai.rows import request_id_for
from qworker.testing.worker_kit import cleanup, kill_group, redis_base_url, spawn_worker, unique_url


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_usage(pid: int) -> tuple[float, float]:
    """(peak RSS in MiB, CPU seconds user+system) of a live process."""
    status = Path(f"/proc/{pid}/status").read_text()
    peak_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return peak_kib / 1024, (int(fields[11]) + int(fields[12])) / ticks


def proc_threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))


class ThreadSampler:
    """The most threads a process had, sampled every 50 ms on a thread of this process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = proc_threads(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, proc_threads(self.pid))
            except (OSError, StopIteration):
                return

    def __enter__(self) -> ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def serve_fake_worker(url: str, name: str, step_ms: float, max_num_seqs: int) -> None:
    """One worker process: the real loop, queue and result store, the scripted FakeEngine."""
    from qworker.backends.connections import open_sink, open_source
    from qworker.config import EngineConfig
    from qworker.testing.fake_engine import FakeEngine
    from qworker.worker.loop import Worker
    from qworker.worker.settings import WorkerSettings

    # KV for every request at once: 16 blocks of 16 tokens each (prompt + 16 tokens fit).
    config = EngineConfig(
        model="fake", block_size=16, num_kv_blocks=16 * max_num_seqs, max_num_seqs=max_num_seqs
    )
    engine = FakeEngine(config, max_model_len=256)
    engine.on_step = lambda n: time.sleep(step_ms / 1000)
    source = open_source(url, consumer=name, lease_timeout_s=60)
    sink = open_sink(url)
    worker = Worker(engine, source, sink, WorkerSettings(name=name, poll_interval_s=0.05))
    worker.install_signal_handlers()
    print(f"qworker worker {name} ready", flush=True)
    worker.run()
    source.close()
    sink.close()


def spawn_fake_worker(
    url: str, name: str, step_ms: float, max_num_seqs: int, log_path: Path
) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-fake-worker", url, name, str(step_ms), str(max_num_seqs)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while f"worker {name} ready" not in log_path.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            kill_group(process)
            raise RuntimeError(f"worker {name} did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    return process


def raise_open_files_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (inherited by the gateway, workers and Redis)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def one_stream(client: httpx.AsyncClient, index: int, max_tokens: int) -> tuple[str, str, float, float]:
    """(response id, assembled text, seconds to the first content chunk, its Unix time)."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": f"Request {index}: name a colour and a fruit."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first_token_s = None
    first_token_at = 0.0
    response_id, text = "", ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            response_id = chunk["id"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") or ""
                if piece and first_token_s is None:
                    first_token_s = time.perf_counter() - started
                    first_token_at = time.time()
                text += piece
    return response_id, text, first_token_s or 0.0, first_token_at


async def run_load(base_url: str, num_requests: int, max_tokens: int, timeout_s: float) -> list:
    limits = httpx.Limits(max_connections=num_requests + 10, max_keepalive_connections=num_requests + 10)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout_s) as client:
        tasks = [one_stream(client, i, max_tokens) for i in range(num_requests)]
        return await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--serve-fake-worker":
        serve_fake_worker(sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--engine", choices=("fake", "model"), default="fake")
    parser.add_argument("--model", default="smollm2", help="--engine model: the workers' model")
    parser.add_argument("--step-ms", type=float, default=20.0, help="--engine fake: sleep per engine step")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    open_files = raise_open_files_limit()

    url = unique_url(redis_base_url(), "load-gateway")
    logs = Path(tempfile.mkdtemp(prefix="load-gateway-"))
    port = free_port()
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qworker",
            "gateway",
            "--port",
            str(port),
            "--max-inflight-requests",
            str(args.num_requests * 2),
            "--limit-concurrency",
            str(args.num_requests * 4),
            "--request-timeout-s",
            str(args.timeout_s),
            "--log-level",
            "WARNING",
        ],
        env={**os.environ, "QWORKER_QUEUE_URL": url, "OMP_NUM_THREADS": "1"},
        stdout=open(logs / "gateway.log", "w"),  # noqa: SIM115 - the process owns it
        stderr=subprocess.STDOUT,
    )
    workers = []
    try:
        per_worker = -(-args.num_requests // args.num_workers)
        workers = [
            spawn_fake_worker(url, f"load-w{i}", args.step_ms, per_worker, logs / f"worker{i}.log")
            if args.engine == "fake"
            else spawn_worker(url, args.model, f"load-w{i}", log_path=logs / f"worker{i}.log")
            for i in range(args.num_workers)
        ]
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base_url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or gateway.poll() is not None:
                raise RuntimeError(f"the gateway did not start: {(logs / 'gateway.log').read_text()[-2000:]}")
            time.sleep(0.2)
        rss_before, cpu_before = proc_usage(gateway.pid)
        threads_idle = proc_threads(gateway.pid)
        started = time.perf_counter()
        with ThreadSampler(gateway.pid) as threads:
            outcomes = asyncio.run(run_load(base_url, args.num_requests, args.max_tokens, args.timeout_s))
        wall_s = time.perf_counter() - started
        peak_rss_mib, cpu_s = proc_usage(gateway.pid)
        failed = [repr(o)[:300] for o in outcomes if isinstance(o, BaseException)]
        done = [o for o in outcomes if not isinstance(o, BaseException)]
        mismatched = 0
        added_ttfts = []
        with Client(queue=url) as client:
            for response_id, text, _, first_at in done:
                stored = client.result(request_id_for(response_id.split("-", 1)[1], "0"), timeout=30)
                mismatched += stored.text != text or stored.status.value != "completed"
                if stored.timings.first_token_at is not None and first_at:
                    added_ttfts.append(first_at - stored.timings.first_token_at)
        ttfts = sorted(t for _, _, t, _ in done)
        summary = {
            "machine": os.uname().machine,
            "engine": args.engine,
            "step_ms": args.step_ms if args.engine == "fake" else None,
            "open_files_limit": open_files,
            "num_requests": args.num_requests,
            "num_workers": args.num_workers,
            "max_tokens": args.max_tokens,
            "completed": len(done),
            "failed": len(failed),
            "mismatched_text": mismatched,
            "wall_s": round(wall_s, 2),
            "median_ttft_ms": round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else None,
            "added_ttft_ms_p50": percentile_ms(added_ttfts, 0.5),
            "added_ttft_ms_p99": percentile_ms(added_ttfts, 0.99),
            "gateway_threads_idle": threads_idle,
            "gateway_threads_peak": threads.peak,
            "gateway_rss_before_mib": round(rss_before, 1),
            "gateway_peak_rss_mib": round(peak_rss_mib, 1),
            "gateway_cpu_s_during_load": round(cpu_s - cpu_before, 2),
            "first_failures": failed[:3],
        }
        print(json.dumps(summary, indent=2))
        if args.out is not None:
            args.out.write_text(json.dumps(summary, indent=2) + "\n")
        if failed or mismatched:
            sys.exit(1)
    finally:
        gateway.terminate()
        for worker in workers:
            worker.terminate()
        for process in [gateway, *workers]:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        cleanup(redis.Redis.from_url(redis_base_url()), url)


if __name__ == "__main__":
    main()
