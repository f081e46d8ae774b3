"""Offline throughput: qworker against transformers' static batching, same requests, same dtype.

    python scripts/bench_offline.py [--workload offline-mixed] [--num-requests N]
                                    [--hf-batch-size 32] [--skip-hf] [--json out.json]

A thin driver over qworker.bench: each system is loaded, warmed up, run through the bench's run
loop on the same requests (random prompt token ids, outputs forced to their sampled length with
ignore_eos) and freed before the next. Prints output tokens/s for each, the ratio, and the KV
cache against a contiguous reservation. `qworker bench` measures the same with latencies, rate
sweeps and plots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from qworker.bench.kv_usage import summarize_kv
from qworker.bench.metrics import summarize
from qworker.bench.registry import BenchSettings, build_system, parse_systems
from qworker.bench.run_loop import run_system, warm_up
from qworker.bench.workload import load_workload, requests_for_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="offline-mixed", help="a packaged workload or a spec file")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    # auto: bf16 where the CPU has bf16 hardware (AMX / AVX512-BF16), else fp32; both systems use it.
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    spec = load_workload(args.workload).with_overrides(num_requests=args.num_requests)
    requests = requests_for_model(spec, args.model)
    print(
        f"workload {spec.name}: {len(requests)} requests, "
        f"{sum(r.prompt_len for r in requests)} prompt / {sum(r.output_len for r in requests)} output tokens"
    )
    settings = BenchSettings(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.hf_batch_size,
        engine_overrides={
            "block_size": args.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
    )
    result: dict[str, Any] = {"workload": spec.name, "num_requests": len(requests), "runs": {}}
    for system_spec in parse_systems("qworker" if args.skip_hf else "qworker,hf-static"):
        system = build_system(system_spec, settings)
        system.prepare()
        warm_up(system)
        run = run_system(system, requests)
        summary = summarize(run.records, run.duration_s)
        kv = summarize_kv(run.kv_samples, run.num_preemptions or 0) if run.kv_samples else None
        result["runs"][system.label] = {"config": system.describe(), "summary": summary, "kv": kv, **run.meta}
        system.close()
        print(
            f"{system.label:10} {summary['output_throughput']:8.1f} output tok/s  ({run.duration_s:.1f}s, "
            f"{summary['completed']}/{summary['num_prompts']} completed, {run.meta})"
        )
        if kv is not None:
            print(
                f"  KV: peak {kv['peak_kv_blocks_used']} of {kv['num_total_kv_blocks']} blocks, "
                f"{kv['kv_waste_pct']:.1f}% of held slots empty; a contiguous prompt+max_tokens "
                f"reservation needs {kv['contiguous_to_paged_slots']:.2f}x the slots; "
                f"{kv['num_preemptions']} preemptions"
            )
    if not args.skip_hf:
        runs = result["runs"]
        ratio = (
            runs["qworker"]["summary"]["output_throughput"]
            / runs["hf-static"]["summary"]["output_throughput"]
        )
        print(f"ratio qworker / hf-static: {ratio:.2f}x")
        result["ratio"] = ratio
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
