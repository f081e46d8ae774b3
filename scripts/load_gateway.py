"""Load through the gateway: N concurrent streaming chat requests through one `qworker gateway` to
several workers (one thread each) on the local Redis. Every stream must complete and its text
equal its stored result; the gateway's peak RSS and CPU time are reported (from /proc).

    .venv/bin/python scripts/load_gateway.py --num-requests 500 --num-workers 2 --max-tokens 16

Not part of `make test`: it runs a minute or more and wants the machine to itself. Prints one JSON
object (also written to --out when given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

from qworker.jobs.client import Client
from qworker.openai.rows import request_id_for
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url


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


async def one_stream(client: httpx.AsyncClient, index: int, max_tokens: int) -> tuple[str, str, float]:
    """(response id, assembled text, seconds to the first content chunk)."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": f"Request {index}: name a colour and a fruit."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first_token_s = None
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
                text += piece
    return response_id, text, first_token_s or 0.0


async def run_load(base_url: str, num_requests: int, max_tokens: int, timeout_s: float) -> list:
    limits = httpx.Limits(max_connections=num_requests + 10, max_keepalive_connections=num_requests + 10)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout_s) as client:
        tasks = [one_stream(client, i, max_tokens) for i in range(num_requests)]
        return await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

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
        workers = [
            spawn_worker(url, args.model, f"load-w{i}", log_path=logs / f"worker{i}.log")
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
        started = time.perf_counter()
        outcomes = asyncio.run(run_load(base_url, args.num_requests, args.max_tokens, args.timeout_s))
        wall_s = time.perf_counter() - started
        peak_rss_mib, cpu_s = proc_usage(gateway.pid)
        failed = [repr(o)[:300] for o in outcomes if isinstance(o, BaseException)]
        done = [o for o in outcomes if not isinstance(o, BaseException)]
        mismatched = 0
        with Client(queue=url) as client:
            for response_id, text, _ in done:
                stored = client.result(request_id_for(response_id.split("-", 1)[1], "0"), timeout=30)
                mismatched += stored.text != text or stored.status.value != "completed"
        ttfts = sorted(t for _, _, t in done)
        summary = {
            "machine": os.uname().machine,
            "num_requests": args.num_requests,
            "num_workers": args.num_workers,
            "max_tokens": args.max_tokens,
            "completed": len(done),
            "failed": len(failed),
            "mismatched_text": mismatched,
            "wall_s": round(wall_s, 2),
            "median_ttft_ms": round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else None,
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
