"""Scale check of the gateway's Batch API (issue 23): a batch of short rows through a pool of
workers, driven by the official openai client (upload, create, poll, download), against
`qworker batch --queue` on the same file, in interleaved rounds (the order flips every round, and
each round has its own batch id, so nothing is collected from an earlier round's results).
Reports rows/s of both paths per round, their medians and ratio, and the gateway's peak RSS
(VmHWM) and CPU time.

    .venv/bin/python scripts/bench_gateway_batch.py --rows 10000 --workers 2 --rounds 3
    .venv/bin/python scripts/bench_gateway_batch.py --rows 200 --rounds 1      # a smoke run

Run it on a quiet machine: the workers, the gateway and the batch runner share its cores. Workers
get one thread each. The model is the tiny random Llama (`--model tiny`, built in a temporary
folder) unless a model directory is given.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import redis

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url, write_tiny_model_dir

API_KEY = "sk-bench-gateway-batch"
MODEL_NAME = "bench"


def rows_of(num_rows: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": MODEL_NAME,
                "prompt": f"Row {i}: the",
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(num_rows)
    ]


def machine() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "")
    marks = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()]
    name, num_cpus = fields.get("Model name", "?").strip(), fields.get("CPU(s)", "?").strip()
    return f"{name}, {num_cpus} CPUs, {' '.join(marks)}"


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def start_gateway(queue_url: str, root: Path, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "QWORKER_API_KEYS": API_KEY,
        "QWORKER_CACHE_DIR": str(root / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    args = [
        "--queue",
        queue_url,
        "--port",
        str(port),
        "--model",
        MODEL_NAME,
        "--files-url",
        str(root / "files"),
    ]
    log = open(root / "gateway.log", "w")  # noqa: SIM115 - the process owns it
    process = subprocess.Popen(
        [sys.executable, "-m", "qworker.cli", "gateway", *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError((root / "gateway.log").read_text()[-3000:])


def run_api(client: openai.OpenAI, source: Path, num_rows: int) -> float:
    """Seconds from the upload to the downloaded output."""
    started = time.perf_counter()
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(source.read_bytes())), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    text = client.files.content(batch.output_file_id).text
    elapsed = time.perf_counter() - started
    assert text.count("\n") == num_rows, f"{text.count(chr(10))} lines for {num_rows} rows"
    return elapsed


def run_cli(queue_url: str, source: Path, root: Path, round_index: int, num_rows: int) -> float:
    out = root / f"cli-{round_index}.jsonl"
    args = ["-i", str(source), "-o", str(out), "--queue", queue_url, "--served-model-name", MODEL_NAME]
    args += ["--batch-id", f"cli-round-{round_index}-{time.time_ns()}", "--progress", "none"]
    args += ["--work-dir", str(root / "work")]
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "qworker.cli", "batch", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=3600,
    )
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_text().count("\n") == num_rows
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="tiny", help="tiny (built here) or a model directory")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--out", type=Path, help="Write the summary JSON here too")
    options = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-gateway-batch-"))
    model_dir = write_tiny_model_dir(root / "model") if options.model == "tiny" else Path(options.model)
    queue_url = unique_url(redis_base_url(), "bench-gw-batch")
    source = root / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows_of(options.rows, options.max_tokens)))
    workers = [
        spawn_worker(queue_url, model_dir, f"bw{i}", log_path=root / f"w{i}.log")
        for i in range(options.workers)
    ]
    gateway = start_gateway(queue_url, root, options.port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{options.port}/v1", api_key=API_KEY, timeout=300)
    api_s: list[float] = []
    cli_s: list[float] = []
    summary: dict[str, Any] = {}
    try:
        for index in range(options.rounds):
            order = ("api", "cli") if index % 2 == 0 else ("cli", "api")
            for path in order:
                if path == "api":
                    api_s.append(run_api(client, source, options.rows))
                else:
                    cli_s.append(run_cli(queue_url, source, root, index, options.rows))
                last_s = (api_s if path == "api" else cli_s)[-1]
                print(f"round {index} {path}: {options.rows / last_s:.1f} rows/s", flush=True)
        summary = {
            "machine": machine(),
            "note": "figures from a shared machine are noisy; compare the ratio. The cli path "
            "includes the `qworker batch` process start (about 2 s), the api path the upload",
            "rows": options.rows,
            "workers": options.workers,
            "rounds": options.rounds,
            "api_rows_per_s": [options.rows / s for s in api_s],
            "cli_rows_per_s": [options.rows / s for s in cli_s],
            "median_api_rows_per_s": options.rows / statistics.median(api_s),
            "median_cli_rows_per_s": options.rows / statistics.median(cli_s),
            "api_over_cli": statistics.median(cli_s) / statistics.median(api_s),
            "gateway_peak_rss_mib": peak_rss_mib(gateway.pid),
            "gateway_cpu_s": cpu_s(gateway.pid),
        }
    finally:
        gateway.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for process in [gateway, *workers]:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        parsed = parse_url(queue_url, SOURCE_PARAMS | SINK_PARAMS)
        cleanup(redis.Redis.from_url(parsed.connection_url), queue_url)
    print(json.dumps(summary, indent=2))
    if options.out is not None:
        options.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
