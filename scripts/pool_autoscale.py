"""An autoscaled worker pool on this machine, and a worker's cold start.

    python scripts/pool_autoscale.py timeline [--cycles 2] [--out bench_out/pool-autoscale]
                                              [--plot-to docs/img/pool-autoscale-timeline.png]
    python scripts/pool_autoscale.py plot bench_out/pool-autoscale/timeline.json --to PNG
    python scripts/pool_autoscale.py cold-start [--model smollm2] [--threads 2] [--repeats 3]
                                                [--first-start N]

timeline: the pool test's scenario (tests/pool_emulator/scenario.py, bursty_config) with more cycles:
KEDA and the HPA played on the exporter's pool-demand signal, real worker processes on a tiny
random Llama, bursts and trickles of jobs on the Redis server at 127.0.0.1:6379 (else the embedded
one). Writes timeline.json (every poll, every worker, every job) and timeline.png.

cold-start: one worker started with a job already waiting, as at scale from zero, timed from
process start to /readyz 200 and to the job's first token (tests/pool_emulator/worker_pool.py). With
--first-start N, first N starts on an empty cache folder (a node's first start: the GGUF
conversion and the CPU kernel build). Prints a JSON record with the machine and its load.

A thin driver over qworker.bench.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis as redis_lib

# The emulator is test support, not part of the installed package: import it from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url, write_tiny_model_dir
from tests.pool_emulator.scenario import (
    bursty_config,
    plot_timeline,
    run_scenario,
    write_timeline_json,
)
from tests.pool_emulator.worker_pool import measure_cold_start

COLD_START_JOB = {
    "messages": [{"role": "user", "content": "Why is the sky blue?"}],
    "params": {"max_tokens": 16, "temperature": 0.0},
}


def machine() -> dict[str, Any]:
    """The CPU, its bf16 flags, and the load on it (these machines are shared)."""
    model_name = platform.processor()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model_name = next(
            (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
            model_name,
        )
    except (OSError, subprocess.SubprocessError):
        pass
    flags: set[str] = set()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = set(
            next(line for line in cpuinfo.splitlines() if line.startswith("flags")).split(":")[1].split()
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model_name,
        "num_cpus": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def drop_keys(url: str) -> None:
    cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)


def timeline(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(write_tiny_model_dir(out / "tiny-llama"))
    config = bursty_config(num_cycles=args.cycles, seed=args.seed)
    url = unique_url(redis_base_url(), tag="pool-autoscale")
    load_before = machine()
    try:
        run = run_scenario(url, model, config, out)
    finally:
        drop_keys(url)
    run.notes["machine"] = load_before
    run.notes["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    run.notes["model"] = (
        "tiny random Llama (2 layers, hidden 64) with the SmolLM2 tokenizer" if not args.model else model
    )
    print(run.format_timeline())
    print(json.dumps(run.summary(), indent=1))
    payload = run.to_json()
    write_timeline_json(run, out / "timeline.json")
    plots = [out / "timeline.png"] + ([Path(args.plot_to)] if args.plot_to else [])
    for path in plots:
        plot_timeline(payload, path, title_of(payload))
    print(f"wrote {out / 'timeline.json'} and " + ", ".join(str(p) for p in plots))


def title_of(payload: dict[str, Any]) -> str:
    policy = payload["config"]["policy"]
    host = payload["notes"].get("machine", {})
    load = host.get("load_average", ["?"])[0]
    model = payload["notes"].get("model", "?").split(" (")[0]
    return (
        f"KEDA + HPA played on qworker_pool_demand_blocks (target {policy['target_value']:g} blocks per "
        f"worker, max {policy['max_replicas']}), {payload['summary']['num_jobs']} jobs, {model};\n"
        f"{host.get('cpu', '?')}, {host.get('num_cpus', '?')} cores shared with other work (1-min load "
        f"{load} at the start)"
    )


def plot(args: argparse.Namespace) -> None:
    payload = json.loads(Path(args.timeline_json).read_text())
    plot_timeline(payload, Path(args.to), title_of(payload))
    print(f"wrote {args.to}")


def cold_start(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    worker_args = ["--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", "64", *args.worker_arg]
    record: dict[str, Any] = {"model": args.model, "threads": args.threads, "worker_args": worker_args}
    record["machine_before"] = machine()
    runs = []
    plan = ["first-start"] * args.first_start + ["warm-cache"] * args.repeats
    for kind in plan:
        url = unique_url(redis_base_url(), tag="cold-start")
        with tempfile.TemporaryDirectory(prefix="qworker-cache-") as empty_cache:
            extra_env = {"QWORKER_CACHE_DIR": empty_cache} if kind == "first-start" else None
            try:
                started = time.monotonic()
                measured = measure_cold_start(
                    url,
                    args.model,
                    worker_args,
                    out,
                    job=COLD_START_JOB,
                    num_threads=args.threads,
                    extra_env=extra_env,
                )
            finally:
                drop_keys(url)
        runs.append(
            {
                "kind": kind,
                "ready_s": round(measured.ready_s, 2),
                "first_token_s": round(measured.first_token_s, 2),
                "result_s": round(measured.result_s, 2),
                "wall_s": round(time.monotonic() - started, 2),
                **measured.details,
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    record["runs"] = runs
    warm = [r for r in runs if r["kind"] == "warm-cache"]
    if warm:
        record["warm_cache_median"] = {
            key: round(statistics.median(r[key] for r in warm), 2) for key in ("ready_s", "first_token_s")
        }
    record["machine_after"] = machine()
    print(json.dumps(record, indent=1))
    (out / "cold_start.json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("timeline", help="an autoscaled pool through bursts of jobs")
    p.add_argument(
        "--cycles", type=int, default=2, help="burst + trickle + quiet gap cycles before the last burst"
    )
    p.add_argument(
        "--model", default=None, help="a model directory (default: a tiny random Llama built here)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/pool-autoscale")
    p.add_argument("--plot-to", default=None, help="also write the plot here (docs/img/...)")
    p.set_defaults(func=timeline)
    r = sub.add_parser("plot", help="draw a stored timeline.json again")
    r.add_argument("timeline_json")
    r.add_argument("--to", required=True, help="the PNG to write")
    r.set_defaults(func=plot)
    c = sub.add_parser("cold-start", help="process start -> ready -> first token of one worker")
    c.add_argument("--model", default="smollm2")
    c.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS (the Deployment's is 2)")
    c.add_argument("--num-kv-blocks", type=int, default=2048, help="the Deployment's pool size")
    c.add_argument("--repeats", type=int, default=3, help="starts with the model cache already built")
    c.add_argument("--first-start", type=int, default=0, help="starts on an empty cache folder first")
    c.add_argument("--worker-arg", action="append", default=[], help="another worker flag (repeatable)")
    c.add_argument("--out", default="bench_out/cold-start")
    c.set_defaults(func=cold_start)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
