"""Stage serving: qworker's engine on the device through qworker.bench's run loop (what `qworker
bench` runs), CUDA graphs on, random weights of the e2e shape (Llama-3.2-1B on the GPU), bf16:

  nano-vllm     nano-vllm's published protocol: 256 sequences, input and output lengths uniform
                in 100-1024, ignore_eos, all at t=0; beside it transformers' static batches on the
                first `serving_hf_batch` of the same requests (one static batch, run to the end)
  shared-prefix the packaged spec scaled to 1,024 requests, prefix caching on, then off
  features      offline-mixed scaled to `features_num_requests`: plain, logprobs top-5 on every
                request, n = 4 on every request (what each costs against plain)
  poisson       online-poisson scaled to `poisson_num_requests`, its rate raised along
                `poisson_rates` until p99 TTFT passes 2 s

offline-mixed scaled to 1,024 requests is the e2e stage's workload (graphs, eager and transformers
there). Every row: throughput and TTFT / TPOT / ITL percentiles (p50, p90, p99), the bench's keys.
Each part is recorded as it finishes (report.partial), so a stage that times out keeps them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from qworker.bench.gpu_check.report import Report, release_memory
from qworker.bench.gpu_check.runs import build_hf_model, engine_system, hf_system, ratio, uniform_requests
from qworker.bench.gpu_check.sizes import Sizes
from qworker.bench.metrics import summarize
from qworker.bench.run import RunLimits
from qworker.bench.run_loop import run_system, warm_up
from qworker.bench.workload import BenchRequest, LengthSpec, generate_requests, load_workload

PERCENTILES = (50.0, 90.0, 99.0)
P99_TTFT_LIMIT_MS = 2000.0
COLUMNS = (
    "completed", "duration", "output_throughput", "total_token_throughput", "mean_ttft_ms",
    "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
)  # fmt: skip


def scaled(name: str, num_requests: int, sizes: Sizes, vocab: int, **overrides: Any) -> list[BenchRequest]:
    """A packaged workload with `num_requests` (the bench's scale option, WorkloadSpec.with_overrides);
    on the CPU smoke run the shared prefix shrinks to fit its short context."""
    spec = load_workload(name).with_overrides(num_requests=num_requests, **overrides)
    if spec.shared_prefix_len and sizes.shared_prefix_len is not None:
        spec = replace(spec, shared_prefix_len=sizes.shared_prefix_len)
    if sizes.device == "cpu":  # the tiny model's short context: short uniform lengths
        spec = replace(
            spec,
            prompt_len=LengthSpec("uniform", min=2, max=16),
            output_len=LengthSpec("uniform", min=2, max=6),
        )
    return generate_requests(spec, vocab)


def run_row(label: str, system: Any, requests: list[BenchRequest], limits: RunLimits) -> dict[str, Any]:
    result = run_system(system, requests, limits=limits)
    summary = summarize(result.records, result.duration_s, percentiles=PERCENTILES)
    row = {"system": label, "num_prompts": len(requests), **{k: summary.get(k) for k in COLUMNS}}
    for key in ("num_prefix_cache_hit_tokens", "num_graph_steps", "num_preemptions"):
        if key in result.meta:
            row[key] = result.meta[key]
    return row


def stage_serving(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch

    result = report.partial
    result.update(runs=[], ratios={}, failures=[])
    stage_limit = report.remaining()
    runs: list[dict[str, Any]] = result["runs"]
    hf = build_hf_model(sizes.e2e_model, getattr(torch, sizes.e2e_dtype), torch.device(sizes.device))
    vocab = sizes.e2e_model["vocab_size"]
    common = dict(
        dtype=sizes.e2e_dtype,
        max_model_len=sizes.e2e_max_model_len,
        kv_cache_memory_bytes=int(sizes.serving_kv_cache_gb * 2**30),
        max_num_seqs=sizes.e2e_max_num_seqs,
        max_num_batched_tokens=sizes.e2e_max_num_batched_tokens,
        block_size=16,
    )

    def share(fraction: float) -> RunLimits:
        # A run may take this fraction of what is left of the stage (the interpreter is slow).
        return report.limits(fraction * report.remaining())

    def engine(label: str, **overrides: Any) -> Any:
        return engine_system(label, hf, sizes, True, **{**common, **overrides})

    def record(row: dict[str, Any], expected: int) -> dict[str, Any]:
        runs.append(row)
        if row["completed"] < expected:
            result["failures"].append(f"{row['system']}: {row['completed']} of {expected} completed")
        return row

    # nano-vllm's protocol.
    low, high = sizes.nano_lengths
    nano = uniform_requests("nano-vllm", sizes.nano_num_requests, vocab, (low, high), (low, high), seed=0)
    system = engine("qworker nano-vllm", enable_prefix_caching=False)
    warm_up(system, requests=[replace(r, output_len=8) for r in nano[:16]])
    nano_row = record(run_row("qworker nano-vllm", system, nano, share(0.3)), len(nano))

    # Logprobs and n = 4 against plain, same engine, same requests.
    features = scaled("offline-mixed", sizes.features_num_requests, sizes, vocab)
    plain = record(run_row("qworker offline-mixed plain", system, features, share(0.1)), len(features))
    # n = 4 runs four sequences per request: up to 4x the steps at max_num_seqs, so more time.
    for label, overrides, fraction in (("logprobs=5", {"logprobs": 5}, 0.1), ("n=4", {"n": 4}, 0.2)):
        system.sampling_overrides = overrides
        row = record(
            run_row(f"qworker offline-mixed {label}", system, features, share(fraction)), len(features)
        )
        result["ratios"][f"duration {label} / plain"] = ratio(row["duration"], plain["duration"])
    system.sampling_overrides = {}

    # Poisson arrivals, the rate raised until p99 TTFT passes 2 s.
    result["poisson"] = []
    for rate in sizes.poisson_rates:
        if report.remaining() < 0.5 * stage_limit:
            break
        requests = scaled("online-poisson", sizes.poisson_num_requests, sizes, vocab, rate=rate)
        row = run_row(f"qworker online-poisson {rate:g}/s", system, requests, share(0.15))
        row["rate"] = rate
        result["poisson"].append(row)
        if (row["p99_ttft_ms"] or 0.0) > P99_TTFT_LIMIT_MS:
            break

    # Shared prefix, prefix caching off on this engine, then on in a fresh one (an empty cache,
    # warmed up on other prompts, so the run's first request is the first to see the prefix).
    shared = scaled("shared-prefix", sizes.shared_prefix_num_requests, sizes, vocab)
    off = record(run_row("qworker shared-prefix caching off", system, shared, share(0.3)), len(shared))
    del system
    release_memory()
    system = engine("qworker shared-prefix caching on", enable_prefix_caching=True)
    warm_up(system, requests=[replace(r, output_len=4) for r in nano[:4]])
    on = record(run_row("qworker shared-prefix caching on", system, shared, share(0.4)), len(shared))
    del system
    release_memory()
    result["ratios"]["shared-prefix output throughput caching on / off"] = ratio(
        on["output_throughput"], off["output_throughput"]
    )

    # transformers' static batches on nano-vllm's first requests: one batch, run to its end.
    batch = nano[: sizes.serving_hf_batch]
    if report.remaining() > 10:
        baseline = hf_system(f"hf-static-b{len(batch)}", hf, len(batch), sizes)
        hf_row = record(run_row(f"transformers static b{len(batch)} nano-vllm (first {len(batch)})",
                                baseline, batch, report.limits(report.remaining())), len(batch))  # fmt: skip
        result["ratios"]["nano-vllm output throughput qworker / transformers static"] = ratio(
            nano_row["output_throughput"], hf_row["output_throughput"]
        )
    else:
        result["hf_skipped"] = "out of the stage's time"
    result["nano_vllm_output_throughput"] = nano_row["output_throughput"]
    return result
