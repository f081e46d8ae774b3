"""Stage e2e: a random Llama with the shape of Llama-3.2-1B (built in code, nothing downloaded):
the offline-mixed workload scaled up, through the engine with and without CUDA graphs and through
transformers `generate` with static batches, in this one run; decode step time with and without
graphs; graphs-vs-eager token agreement in bf16."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

from qworker.bench.gpu_check.report import Report, release_memory
from qworker.bench.gpu_check.runs import (
    build_hf_model,
    engine_system,
    hf_system,
    measure,
    ratio,
    token_lists,
    uniform_requests,
)
from qworker.bench.gpu_check.sizes import Sizes
from qworker.bench.run import RunLimits
from qworker.bench.run_loop import run_system, warm_up
from qworker.bench.workload import BenchRequest, LengthSpec, generate_requests, load_workload


def offline_mixed(sizes: Sizes, vocab_size: int) -> list[BenchRequest]:
    """The packaged offline-mixed workload, scaled to the run's size."""
    spec = load_workload("offline-mixed").with_overrides(num_requests=sizes.e2e_num_requests)
    if sizes.e2e_lengths is not None:
        (p_min, p_max), (o_min, o_max) = sizes.e2e_lengths
        spec = replace(
            spec,
            prompt_len=LengthSpec("uniform", min=p_min, max=p_max),
            output_len=LengthSpec("uniform", min=o_min, max=o_max),
        )
    return generate_requests(spec, vocab_size)


def stage_e2e(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch

    device = torch.device(sizes.device)
    t = time.perf_counter()
    hf = build_hf_model(sizes.e2e_model, getattr(torch, sizes.e2e_dtype), device)
    hf_build_s = time.perf_counter() - t
    t = time.perf_counter()
    system = engine_system(
        "qworker-graphs",
        hf,
        sizes,
        True,
        dtype=sizes.e2e_dtype,
        max_model_len=sizes.e2e_max_model_len,
        kv_cache_memory_bytes=int(sizes.e2e_kv_cache_gb * 2**30),
        max_num_seqs=sizes.e2e_max_num_seqs,
        max_num_batched_tokens=sizes.e2e_max_num_batched_tokens,
        block_size=16,
    )
    runner = system.engine.runner
    engine_build_s = time.perf_counter() - t
    vocab = sizes.e2e_model["vocab_size"]
    requests = offline_mixed(sizes, vocab)
    setup: dict[str, Any] = {
        "model": "Llama-3.2-1B shape, random weights" if sizes.device == "cuda" else "tiny random Llama",
        "num_parameters": sum(p.numel() for p in hf.parameters()),
        "dtype": sizes.e2e_dtype,
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "kv_blocks": system.engine.num_kv_blocks,
        "max_num_seqs": sizes.e2e_max_num_seqs,
        "max_num_batched_tokens": sizes.e2e_max_num_batched_tokens,
        "graph_sizes": str(runner.cuda_graphs.sizes),
        "hf_build_s": hf_build_s,
        "engine_build_s_with_graph_capture": engine_build_s,
    }
    failures: list[str] = []
    # Compiles the varlen and decode kernel variants outside the timed runs.
    warm_up(system, requests=[replace(r, output_len=8) for r in requests[:16]])

    runs: list[dict[str, Any]] = []
    report.partial.update(setup=setup, runs=runs)  # kept if the stage times out
    row, graph_result = measure(system, requests, report.limits(0.3 * report.remaining()))
    runs.append(row)
    # The same engine, eager (what enforce_eager=True builds), under its own name in the table.
    runner.disable_cuda_graphs()
    system.label = "qworker-eager"
    row, eager_result = measure(system, requests, report.limits(0.4 * report.remaining()))
    runs.append(row)

    # Decode step time at fixed batch sizes: short prompts, every step a pure decode after the first.
    decode_steps: list[dict[str, Any]] = []
    report.partial["decode_steps"] = decode_steps
    prompt_len, output_len = sizes.decode_prompt_len, sizes.decode_output_len
    for batch in sizes.decode_batches:
        decode_requests = uniform_requests(
            f"decode-b{batch}", batch, vocab, (prompt_len, prompt_len), (output_len, output_len), seed=1
        )
        for mode in ("graphs", "eager"):
            if mode == "graphs":
                runner.enable_cuda_graphs(allow_cpu=sizes.device == "cpu")
            else:
                runner.disable_cuda_graphs()
            # The first run of a shape compiles its prefill kernels; the second is the measurement.
            measure(system, decode_requests, report.limits(10))
            m, _ = measure(system, decode_requests, report.limits(10))
            decode_steps.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "mean_tpot_ms": m["mean_tpot_ms"],
                    "output_throughput": m["output_throughput"],
                }
            )

    # bf16 greedy tokens, graphs vs eager, on the workload's requests. Not a pass/fail check: graph
    # replays pad the batch and fix the split count, so bf16 roundings differ and a random model's
    # near-tied logits may flip (the fp32 parity stage is the exact check).
    graph_tokens, eager_tokens = token_lists(graph_result, requests), token_lists(eager_result, requests)
    same = sum(a == b for a, b in zip(graph_tokens, eager_tokens, strict=True))
    agree = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(graph_tokens, eager_tokens, strict=True)
    ]
    graph_vs_eager = {
        "requests_identical": f"{same}/{len(requests)}",
        "mean_tokens_before_first_difference": statistics.fmean(agree) if agree else None,
    }
    for r in runs:
        if r["completed"] < len(requests):
            failures.append(f"{r['system']} completed {r['completed']} of {len(requests)} requests")

    # transformers generate, static batches, same device and requests. Time-boxed by whole
    # batches: one batch measures the pace (and warms up), then as many batches as the budget
    # holds run as the measurement, so no batch is cut short and every counted token is real.
    del system, runner
    release_memory()
    engine_best = max(r["output_throughput"] for r in runs)
    hf_runs = []
    for batch_size in sizes.hf_batch_sizes:
        baseline = hf_system(f"hf-static-b{batch_size}", hf, batch_size, sizes)
        budget_s = max(3.0, min(60.0, (report.remaining() - 2) / (2 * len(sizes.hf_batch_sizes))))
        pace = run_system(baseline, requests[:batch_size], limits=RunLimits(drain_timeout_s=budget_s))
        num_batches = max(1, int(budget_s / max(pace.duration_s, 1e-3)))
        subset = requests[: num_batches * batch_size]
        row, _ = measure(baseline, subset, RunLimits(drain_timeout_s=2 * budget_s))
        hf_runs.append(row)
    runs += hf_runs
    hf_best = max(hf_runs, key=lambda r: r["output_throughput"])
    ratios = {
        f"output_throughput qworker-best / {r['system']}": ratio(engine_best, r["output_throughput"])
        for r in hf_runs
    }
    ratios["output_throughput graphs / eager"] = ratio(
        runs[0]["output_throughput"], runs[1]["output_throughput"]
    )
    return {
        "setup": setup,
        "runs": runs,
        "ratios": ratios,
        "best_engine_over_best_hf": ratio(engine_best, hf_best["output_throughput"]),
        "decode_steps": decode_steps,
        "graph_vs_eager_bf16": graph_vs_eager,
        "failures": failures,
    }
