"""Queue overhead: a workload end to end through Redis against the engine alone, on one engine in
one process, so that the ratio is measured on the same machine state.

    python scripts/bench_queue.py [--workload offline-mixed] [--write-docs]

A thin driver over qworker.bench: both modes are the bench's run loop on the same requests.
Engine-only: the engine system adds every request and steps until all finish. Queue: a worker on
the main thread (on the same engine) pulls jobs by admission and writes results to Redis, while
the run loop, beside it in a thread, submits every job and reads the results (the queue system
without streaming, as a bulk client does); the clock stops when the client has read every result.
Runs alternate (engine, queue, engine, queue, ...) and the best of each is kept, because the
machine is shared.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qworker.backends.connections import open_sink, open_source
from qworker.bench.metrics import summarize
from qworker.bench.queue_client import QueueClientSystem
from qworker.bench.qworker_engine import QworkerEngineSystem
from qworker.bench.report import format_number, markdown_table
from qworker.bench.run import RunResult
from qworker.bench.run_loop import run_system, warm_up
from qworker.bench.workload import BenchRequest, load_workload, requests_for_model
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from qworker.worker.loop import Worker, run_beside
from qworker.worker.settings import WorkerSettings

DOCS_START = "<!-- bench_queue:start -->"
DOCS_END = "<!-- bench_queue:end -->"
SUMMARY_KEYS = (
    "duration",
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
)


def summary(mode: str, result: RunResult) -> dict[str, Any]:
    full = summarize(result.records, result.duration_s)
    return {"mode": mode, **{key: full[key] for key in SUMMARY_KEYS}}


def run_queue(
    engine: LLMEngine, requests: list[BenchRequest], base_url: str, max_backlog: int, log_dir: Path
) -> dict[str, Any]:
    url = unique_url(base_url, tag="bench")
    worker = Worker(
        engine,
        open_source(url, consumer="bench"),
        open_sink(url),
        WorkerSettings(name="bench", max_backlog=max_backlog),
    )
    config = engine.config
    client = QueueClientSystem(
        "queue", url, log_dir, config.model, config.dtype, config.device, spawn_worker=False, stream=False
    )

    def client_side() -> RunResult:
        client.prepare()
        warm_up(client)
        return run_system(client, requests)

    try:
        # The worker (so the engine) keeps the main thread; see run_beside.
        result = run_beside(worker, client_side)
    finally:
        # After the worker stopped: it blocks on the stream until then.
        if client.client is not None:
            cleanup(client.client.producer.redis, url)
        client.close()
    return summary("queue", result)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def write_docs(path: Path, report: dict[str, Any]) -> None:
    e, q = report["engine_only"], report["queue"]
    rows = [
        [r["mode"], format_number(r["duration"], 3)]
        + [
            format_number(r[key], 2)
            for key in ("request_throughput", "output_throughput", "total_token_throughput")
        ]
        for r in (e, q)
    ]
    section = "\n".join(
        [
            DOCS_START,
            "## Queue overhead (scripts/bench_queue.py)",
            "",
            f"Workload `{report['workload']}`, {report['num_requests']} requests, model `{report['model']}` "
            f"({report['dtype']}, {report['cpu']}), best of {report['repeats']} alternating runs, one engine "
            f"in one process, {report['date']}.",
            "",
            *markdown_table(
                ["mode", "duration s", "request_throughput", "output_throughput", "total_token_throughput"],
                rows,
            ),
            "",
            f"End to end through Redis: **{report['ratio'] * 100:.1f}%** of engine-only output throughput "
            "(target: at least 95%). Each alternating pair: "
            + ", ".join(f"{r * 100:.1f}%" for r in report["pair_ratios"])
            + ".",
            "",
            f"Command: `{report['command']}`",
            DOCS_END,
        ]
    )
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if DOCS_START in text:
        head, rest = text.split(DOCS_START, 1)
        text = head + section + rest.split(DOCS_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="offline-mixed", help="a packaged workload or a spec file")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--queue", default=None, help="Redis URL (default: 127.0.0.1:6379, else embedded)")
    parser.add_argument("--num-requests", type=int, default=None, help="override the workload's count")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-backlog", type=int, default=16)
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up run")
    parser.add_argument("--write-docs", action="store_true", help="update docs/BENCHMARKS.md")
    args = parser.parse_args()

    spec = load_workload(args.workload).with_overrides(num_requests=args.num_requests)
    requests = requests_for_model(spec, args.model)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    engine_only = QworkerEngineSystem("engine-only", engine.config, engine=engine)
    base_url = args.queue or redis_base_url()
    # Where a spawned worker would log; this bench runs its worker in-process.
    log_dir = Path(tempfile.gettempdir())
    if not args.no_warmup:
        # The whole workload once, unmeasured: compiled kernels specialise on batch shapes, and the
        # first run through them is several times slower than the next (seen on CPU).
        warm_up(engine_only, requests=requests)
    engine_runs, queue_runs = [], []
    for _ in range(args.repeats):
        engine_runs.append(summary("engine-only", run_system(engine_only, requests)))
        print(json.dumps(engine_runs[-1]), flush=True)
        queue_runs.append(run_queue(engine, requests, base_url, args.max_backlog, log_dir))
        print(json.dumps(queue_runs[-1]), flush=True)
    best_engine = max(engine_runs, key=lambda r: r["output_throughput"])
    best_queue = max(queue_runs, key=lambda r: r["output_throughput"])
    report = {
        "workload": spec.name,
        "num_requests": len(requests),
        "model": args.model,
        "repeats": args.repeats,
        "engine_only": best_engine,
        "queue": best_queue,
        "ratio": round(best_queue["output_throughput"] / best_engine["output_throughput"], 4),
        "pair_ratios": [
            round(q["output_throughput"] / e["output_throughput"], 4)
            for e, q in zip(engine_runs, queue_runs, strict=True)
        ],
        "dtype": str(engine.dtype).removeprefix("torch."),
        "cpu": cpu_model(),
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(report, indent=2))
    if args.write_docs:
        write_docs(Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md", report)


if __name__ == "__main__":
    main()
