"""Queue overhead (issue 3, acceptance 8): a workload end to end through Redis against the engine
alone, on one engine in one process, so that the ratio is measured on the same machine state.

    python scripts/bench_queue.py [--workload ../shared/workloads/offline-mixed.json] [--write-docs]

Engine-only: add every request, step until all finish. Queue: a client thread submits every job
and waits for the results; a worker on the main thread (on the same engine) pulls them by
admission and streams deltas and results to Redis; the clock stops when the client has read every
result. Runs alternate
(engine, queue, engine, queue, ...) and the best of each is kept, because the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from qworker.bench.workload import WorkloadSpec, generate_requests, load_workload
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.worker.client import Client
from qworker.worker.connections import open_sink, open_source
from qworker.worker.loop import Worker, run_beside
from qworker.worker.settings import WorkerSettings
from qworker.worker.testing import cleanup, redis_base_url, unique_url

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "offline-mixed.json"
DOCS_START = "<!-- bench_queue:start -->"
DOCS_END = "<!-- bench_queue:end -->"


def make_requests(
    spec: WorkloadSpec, engine: LLMEngine, num_requests: int | None
) -> list[tuple[list[int], SamplingParams]]:
    """The workload's requests, from the same generator as `qworker bench` and bench_offline.py."""
    if num_requests:
        spec = spec.with_overrides(num_requests=num_requests)
    bench_requests = generate_requests(
        spec, engine.model_config.vocab_size, excluded_token_ids=sorted(engine.eos_token_ids)
    )
    return [
        (
            r.prompt_token_ids,
            SamplingParams(max_tokens=r.output_len, temperature=r.temperature, ignore_eos=r.ignore_eos),
        )
        for r in bench_requests
    ]


def summary(name: str, seconds: float, requests: list, num_output_tokens: int, completed: int) -> dict:
    num_prompt_tokens = sum(len(prompt) for prompt, _ in requests)
    return {
        "mode": name,
        "duration_s": round(seconds, 3),
        "completed": completed,
        "failed": len(requests) - completed,
        "request_throughput": round(completed / seconds, 4),
        "output_throughput": round(num_output_tokens / seconds, 2),
        "total_token_throughput": round((num_output_tokens + num_prompt_tokens) / seconds, 2),
    }


def run_engine_only(engine: LLMEngine, requests: list, tag: str) -> dict:
    started = time.perf_counter()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    num_output_tokens = 0
    completed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                completed += 1
                num_output_tokens += len(out.output.outputs[0].token_ids)
    return summary("engine-only", time.perf_counter() - started, requests, num_output_tokens, completed)


def run_queue(engine: LLMEngine, requests: list, base_url: str, max_backlog: int) -> dict:
    url = unique_url(base_url, tag="bench")
    client = Client(queue=url)
    worker = Worker(
        engine,
        open_source(url, consumer="bench"),
        open_sink(url),
        WorkerSettings(name="bench", max_backlog=max_backlog),
    )
    jobs = [
        {"prompt_token_ids": prompt, "params": {"max_tokens": p.max_tokens, "temperature": p.temperature,
                                                "ignore_eos": p.ignore_eos}}
        for prompt, p in requests
    ]  # fmt: skip

    def submit_and_wait() -> tuple[list, float]:
        started = time.perf_counter()
        job_ids = client.submit_many(jobs)
        results = client.results(job_ids, timeout=3600)
        return results, time.perf_counter() - started

    # The worker (so the engine) keeps the main thread; see run_beside.
    results, seconds = run_beside(worker, submit_and_wait)
    completed = sum(r.status.value == "completed" for r in results)
    num_output_tokens = sum(r.usage.completion_tokens for r in results)
    out = summary("queue", seconds, requests, num_output_tokens, completed)
    cleanup(client.producer.redis, url)
    client.close()
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def write_docs(path: Path, report: dict) -> None:
    e, q = report["engine_only"], report["queue"]
    section = "\n".join(
        [
            DOCS_START,
            "## Queue overhead (scripts/bench_queue.py)",
            "",
            f"Workload `{report['workload']}`, {report['num_requests']} requests, model `{report['model']}` "
            f"({report['dtype']}, {report['cpu']}), best of {report['repeats']} alternating runs, one engine "
            f"in one process, {report['date']}.",
            "",
            "| mode | duration s | request_throughput | output_throughput | total_token_throughput |",
            "|---|---|---|---|---|",
            *(
                f"| {r['mode']} | {r['duration_s']} | {r['request_throughput']} | {r['output_throughput']} | "
                f"{r['total_token_throughput']} |"
                for r in (e, q)
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
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--queue", default=None, help="Redis URL (default: 127.0.0.1:6379, else embedded)")
    parser.add_argument("--num-requests", type=int, default=None, help="override the workload's count")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-backlog", type=int, default=16)
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up run")
    parser.add_argument("--write-docs", action="store_true", help="update docs/BENCHMARKS.md")
    args = parser.parse_args()

    spec = load_workload(args.workload)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    requests = make_requests(spec, engine, args.num_requests)
    base_url = args.queue or redis_base_url()
    if not args.no_warmup:
        # The whole workload once, unmeasured: compiled kernels specialise on batch shapes, and the
        # first run through them is several times slower than the next (seen on CPU).
        run_engine_only(engine, requests, "warmup")
    engine_runs, queue_runs = [], []
    for i in range(args.repeats):
        engine_runs.append(run_engine_only(engine, requests, f"r{i}"))
        print(json.dumps(engine_runs[-1]), flush=True)
        queue_runs.append(run_queue(engine, requests, base_url, args.max_backlog))
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
