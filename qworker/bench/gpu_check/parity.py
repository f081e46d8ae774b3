"""Stage parity: a small fp32 random Llama; greedy tokens of transformers, the torch backend, the
Triton backend eager (enforce_eager=True) and with CUDA graphs (padded batches, chunked prefill,
preemption) must all be identical. bf16 graphs vs eager is informative."""

from __future__ import annotations

from typing import Any

from qworker.bench.gpu_check.report import Report, limits_until
from qworker.bench.gpu_check.runs import (
    build_hf_model,
    engine_system,
    hf_system,
    measure,
    token_lists,
    uniform_requests,
)
from qworker.bench.gpu_check.sizes import Sizes
from qworker.bench.workload import BenchRequest


def stage_parity(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch

    hf = build_hf_model(sizes.parity_model, torch.float32, torch.device(sizes.device), widen=3.0)
    requests = uniform_requests(
        "parity",
        sizes.parity_num_requests,
        sizes.parity_model["vocab_size"],
        (1, sizes.parity_max_prompt),
        (2, sizes.parity_max_output),
        seed=0,
    )
    common = dict(dtype="float32", max_num_seqs=sizes.parity_num_requests, block_size=16)
    deadline = report.until(report.remaining())
    checks: list[dict[str, Any]] = []
    failures: list[str] = []
    systems: dict[str, Any] = {}

    def run(label: str, system: Any, subset: list[BenchRequest]) -> list[list[int]]:
        systems[label] = system
        row, result = measure(system, subset, limits_until(deadline))
        if row["completed"] < len(subset):
            failures.append(f"{label}: {row['completed']} of {len(subset)} completed (time budget?)")
        return token_lists(result, subset)

    graphs_tokens = run("triton-graphs", engine_system("triton-graphs", hf, sizes, True, **common), requests)
    eager = engine_system("triton-eager", hf, sizes, False, enforce_eager=True, **common)
    eager_tokens = run("triton-eager", eager, requests)
    torch_backend = engine_system("torch-backend", hf, sizes, False, attention_backend="torch", **common)
    torch_tokens = run("torch-backend", torch_backend, requests)
    # A pool that holds the longest request alone, no more: running requests get preempted.
    block_size = sizes.parity_preempt_block_size
    num_kv_blocks = -(-max(r.prompt_len + r.output_len for r in requests) // block_size)
    chunked = engine_system(
        "triton-graphs-chunked-preempt",
        hf,
        sizes,
        True,
        **common
        | dict(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max(8, min(64, sizes.parity_max_prompt // 2)),
        ),
    )
    chunked_tokens = run("triton-graphs-chunked-preempt", chunked, requests)
    hf_tokens = run("hf-sequential", hf_system("hf-sequential", hf, 1, sizes), requests[:8])
    if eager.engine.runner.cuda_graphs is not None:
        failures.append("enforce_eager=True still built CUDA graphs")

    def check(
        name: str, tokens: list[list[int]], reference: list[list[int]], label: str | None = None
    ) -> None:
        identical = tokens == reference
        engine = systems[label].engine if label is not None else None
        graphs = engine.runner.cuda_graphs if engine is not None else None
        checks.append(
            {
                "check": name,
                "identical": identical,
                "num_requests": len(reference),
                "graph_runs": graphs.num_runs if graphs is not None else None,
                "preemptions": engine.scheduler.num_preemptions if engine is not None else None,
            }
        )
        if not identical:
            bad = [i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b]
            failures.append(f"{name}: {len(bad)} of {len(reference)} requests differ (first: {bad[:5]})")

    check("torch backend == transformers (first 8)", torch_tokens[:8], hf_tokens)
    check("triton eager == torch backend", eager_tokens, torch_tokens, "triton-eager")
    check("triton graphs == triton eager", graphs_tokens, eager_tokens, "triton-graphs")
    check(
        "triton graphs, chunked + preemption == eager",
        chunked_tokens,
        eager_tokens,
        "triton-graphs-chunked-preempt",
    )
    # bf16, the serving dtype: graphs vs eager on the same widened model. Informative: padded
    # graph batches change bf16 matmul rounding, so a near-tie can flip (fp32 above is exact).
    hf16 = hf.to(torch.bfloat16)
    bf16 = dict(common, dtype="bfloat16")
    bf16_graphs = run("bf16-graphs", engine_system("bf16-graphs", hf16, sizes, True, **bf16), requests)
    bf16_eager = engine_system("bf16-eager", hf16, sizes, False, enforce_eager=True, **bf16)
    bf16_eager_tokens = run("bf16-eager", bf16_eager, requests)
    bf16_same = sum(a == b for a, b in zip(bf16_graphs, bf16_eager_tokens, strict=True))
    graphs = systems["triton-graphs"].engine.runner.cuda_graphs
    if not graphs.num_runs:
        failures.append("no decode step ran through the CUDA graphs")
    if not chunked.engine.scheduler.num_preemptions:
        failures.append("the preemption run did not preempt (KV pool too large)")
    return {
        "checks": checks,
        "bf16_graphs_vs_eager_identical": f"{bf16_same}/{len(requests)}",
        "graph_sizes": graphs.sizes,
        "failures": failures,
    }
