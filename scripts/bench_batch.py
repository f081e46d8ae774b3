"""Bulk evaluation throughput: `qworker batch` against LLM.generate on the same rows, side by side.

    python scripts/bench_batch.py [--workload offline-mixed] [--num-requests N] [--model smollm2]
                                  [--skip-pool] [--json out.json]

A thin driver over qworker.bench and qworker.batch. The workload's requests (random prompt token
ids, outputs forced to their length with ignore_eos) are written as a JSONL batch file of
/v1/completions rows. Three runs, each warmed up first and timed without the model's loading:
LLM.generate on all requests at once; `qworker batch` in this process (local mode); and
`qworker batch --queue` across a pool of one `qworker worker` subprocess on a fresh Redis stream.
Prints output tok/s for each and the ratios to LLM.generate; with --repeats N, N interleaved
rounds and the median of each system.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qworker import LLM, SamplingParams
from qworker.batch.command import BatchRun, run_batch
from qworker.bench.queue_client import QueueClientSystem
from qworker.bench.qworker_engine import sampling_params_for
from qworker.bench.run_loop import WARMUP_OUTPUT_LEN, WARMUP_PROMPT, warm_up
from qworker.bench.workload import BenchRequest, load_workload, requests_for_model
from qworker.cli_options import config_to_args
from qworker.config import EngineConfig
from qworker.openai.batches.progress import ProgressMode

MODEL_NAME = "bench"


def batch_rows(requests: list[BenchRequest]) -> list[dict[str, Any]]:
    rows = []
    for request in requests:
        params = sampling_params_for(request)
        body = {
            "model": MODEL_NAME,
            "prompt": request.prompt_token_ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "ignore_eos": params.ignore_eos,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        rows.append(
            {"custom_id": request.request_id, "method": "POST", "url": "/v1/completions", "body": body}
        )
    return rows


def warm_llm(config: EngineConfig) -> LLM:
    fields = {k: v for k, v in vars(config).items() if k != "model"}
    llm = LLM(model=config.model, **fields)
    llm.generate([{"prompt_token_ids": list(WARMUP_PROMPT)}], SamplingParams(max_tokens=WARMUP_OUTPUT_LEN))
    return llm


def time_generate(config: EngineConfig, requests: list[BenchRequest]) -> dict[str, float]:
    llm = warm_llm(config)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, [sampling_params_for(r) for r in requests])
    wall_s = time.perf_counter() - started
    num_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    return {
        "wall_s": wall_s,
        "output_tokens": num_tokens,
        "output_throughput": num_tokens / wall_s,
        "preemptions": llm.llm_engine.scheduler.num_preemptions,
    }


def time_batch(run: BatchRun, config: EngineConfig, local: bool) -> dict[str, float]:
    engine = warm_llm(config).llm_engine if local else None
    summary = run_batch(run, config, engine=engine)
    assert summary.num_failed == 0, summary.to_text()
    result = {
        "wall_s": summary.wall_s,
        "output_tokens": summary.num_completion_tokens,
        "output_throughput": summary.output_throughput,
    }
    if engine is not None:
        result["preemptions"] = engine.scheduler.num_preemptions
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="offline-mixed", help="a packaged workload or a spec file")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-pool", action="store_true", help="no run across a one-worker pool")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of all systems, interleaved")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    spec = load_workload(args.workload).with_overrides(num_requests=args.num_requests)
    requests = requests_for_model(spec, args.model)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    print(f"workload {spec.name}: {len(requests)} rows, {sum(r.output_len for r in requests)} output tokens")
    # Rounds interleave the systems (generate, local, pool, then again), so that a machine whose
    # speed drifts during the run (a shared host) slows each of them alike. Every run gets a fresh
    # engine (the pool a fresh worker process), so no prefix-cache hits carry over from a previous
    # round of the same requests.
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="qworker-bench-batch-") as folder:
        work = Path(folder)
        source = work / "in.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in batch_rows(requests)))

        def batch_run(name: str, queue: str | None = None) -> BatchRun:
            return BatchRun(
                input=str(source),
                output=str(work / f"{name}-{time.time_ns()}.jsonl"),
                queue=queue,
                served_model_names=[MODEL_NAME],
                batch_id=f"bench-{name}-{time.time_ns()}",
                work_dir=work,
                progress=ProgressMode.NONE,
            )

        for number in range(1, args.repeats + 1):
            results = {"LLM.generate": time_generate(config, requests)}
            results["qworker batch"] = time_batch(batch_run("local"), config, local=True)
            if not args.skip_pool:
                results["qworker batch --queue (1 worker)"] = time_pool(
                    config, work, lambda url: batch_run("pool", url)
                )
            rounds.append(results)
            print(f"round {number} of {args.repeats}")
            report(results)
    summary = {name: median_run([r[name] for r in rounds]) for name in rounds[0]}
    if args.repeats > 1:
        print(f"median of {args.repeats} rounds")
        report(summary)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"workload": spec.name, "num_rows": len(requests), "median": summary, "rounds": rounds},
                indent=2,
            )
        )


def time_pool(config: EngineConfig, work: Path, make_run: Callable[[str], BatchRun]) -> dict[str, float]:
    """`qworker batch --queue` across one fresh `qworker worker` subprocess on a fresh stream."""
    system = QueueClientSystem(
        "pool-1",
        None,
        work,
        config.model,
        config.dtype,
        config.device,
        config_to_args(config, exclude=("model", "dtype", "device")),
        stream=False,
    )
    system.prepare()
    try:
        warm_up(system)
        return time_batch(make_run(system.url), config, local=False)
    finally:
        system.close()


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (of an even count, the lower middle one)."""
    ordered = sorted(runs, key=lambda run: run["output_throughput"])
    return ordered[(len(ordered) - 1) // 2]


def report(results: dict[str, dict[str, float]]) -> None:
    baseline = results["LLM.generate"]["output_throughput"]
    for name, result in results.items():
        ratio = result["output_throughput"] / baseline
        print(
            f"{name:34} {result['output_throughput']:8.1f} output tok/s  "
            f"({result['wall_s']:.1f} s, {result['output_tokens']:.0f} tokens)  {ratio:.2f}x LLM.generate"
            + (f"  {result['preemptions']:.0f} preemptions" if "preemptions" in result else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
