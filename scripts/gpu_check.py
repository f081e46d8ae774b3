"""One prepared check of the GPU path, for a machine with an NVIDIA GPU (run by scripts/gpu_check.sh).

Stages, each recorded in OUT/gpu_check.json (rewritten after every stage, so a kill keeps what
finished) and summarized in OUT/gpu_check.md:
  env      versions, device, and that the engine and the bench import without pydantic, redis or boto3
  kernels  every Triton kernel against its plain-torch reference (qworker_kernels.testing)
  bench    scripts/bench_triton_kernels.py: decode attention bandwidth vs HBM peak and vs a
           device-to-device copy measured in the same run, batch 1/16/64/256 x ctx 512/2048/8192
  parity   a small fp32 random Llama: greedy tokens of transformers, the torch backend, the
           Triton backend eager (enforce_eager=True) and with CUDA graphs (padded batches,
           chunked prefill, preemption) must all be identical
  e2e      a random Llama with the shape of Llama-3.2-1B (built in code, nothing downloaded):
           the offline-mixed workload scaled up, through the engine with and without CUDA graphs
           and through transformers `generate` with static batches, in this one run; decode step
           time with and without graphs; graphs-vs-eager token agreement in bf16
  pytest   tests/kernels/test_triton_*.py on the GPU, when pytest and hypothesis are installed

Every engine and baseline run goes through qworker.bench's run loop and metrics, on requests from
its workload generator. Only torch, triton, transformers and numpy are needed. `--cpu-smoke` runs
every stage with tiny sizes on the CPU under TRITON_INTERPRET=1 (CUDA graphs there: the same
padded static buffers, run eagerly).

    python scripts/gpu_check.py OUT_DIR [--cpu-smoke] [--budget-s 420] [--stages kernels,bench,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qworker.bench.metrics import summarize
from qworker.bench.report import markdown_table
from qworker.bench.run import RunLimits, RunResult
from qworker.bench.run_loop import run_system, warm_up
from qworker.bench.system import System
from qworker.bench.workload import BenchRequest, LengthSpec, generate_requests, load_workload, parse_workload

REPO = Path(__file__).resolve().parents[1]
HBM_PEAK_GBPS = 4800.0  # H200 datasheet: 4.8 TB/s
FORBIDDEN_MODULES = ("pydantic", "redis", "boto3")
STAGES = ("env", "kernels", "bench", "parity", "e2e", "pytest")
PERCENTILES = (99.0,)

# Llama-3.2-1B's shape. Plain RoPE with its theta: llama3 rope scaling changes the tables, not
# the cost, and its config keys differ across transformers versions.
LLAMA_1B_SHAPE = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
)
TINY_LLAMA_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@dataclass
class Sizes:
    """Everything that differs between the GPU run and the CPU smoke run."""

    device: str
    e2e_dtype: str
    e2e_model: dict[str, Any]
    e2e_max_model_len: int
    e2e_kv_cache_gb: float
    e2e_num_requests: int
    # (min, max) prompt and output lengths instead of the offline-mixed spec's own; None: its own.
    e2e_lengths: tuple[tuple[int, int], tuple[int, int]] | None
    e2e_max_num_seqs: int
    e2e_max_num_batched_tokens: int
    hf_batch_sizes: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_prompt_len: int
    decode_output_len: int
    parity_model: dict[str, Any]
    parity_num_requests: int
    parity_max_prompt: int
    parity_max_output: int
    # The preemption run's block size: small enough that decodes cross block boundaries often.
    parity_preempt_block_size: int
    kernel_block_sizes: tuple[int, ...]
    kernel_head_dims: tuple[int, ...]
    kernel_gqa: tuple[int, ...]
    kernel_dtypes: tuple[str, ...]
    norm_hidden: tuple[int, ...]


GPU_SIZES = Sizes(
    device="cuda",
    e2e_dtype="bfloat16",
    e2e_model=LLAMA_1B_SHAPE,
    e2e_max_model_len=2048,
    e2e_kv_cache_gb=12.0,
    e2e_num_requests=1024,
    e2e_lengths=None,
    e2e_max_num_seqs=256,
    e2e_max_num_batched_tokens=4096,
    hf_batch_sizes=(32,),
    decode_batches=(1, 8, 64, 256),
    decode_prompt_len=128,
    decode_output_len=64,
    parity_model=dict(
        TINY_LLAMA_SHAPE,
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        max_position_embeddings=1024,
    ),
    parity_num_requests=48,
    parity_max_prompt=300,
    parity_max_output=40,
    parity_preempt_block_size=16,
    kernel_block_sizes=(16, 32),
    kernel_head_dims=(64, 128),
    kernel_gqa=(1, 3, 8),
    kernel_dtypes=("bfloat16", "float16", "float32"),
    norm_hidden=(2048, 4096, 1000),
)

CPU_SMOKE_SIZES = Sizes(
    device="cpu",
    e2e_dtype="float32",
    e2e_model={**TINY_LLAMA_SHAPE, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
    e2e_max_model_len=128,
    e2e_kv_cache_gb=0.01,
    e2e_num_requests=6,
    e2e_lengths=((4, 24), (2, 6)),
    e2e_max_num_seqs=4,
    e2e_max_num_batched_tokens=32,
    hf_batch_sizes=(4,),
    decode_batches=(1, 3),
    decode_prompt_len=4,
    decode_output_len=3,
    parity_model=TINY_LLAMA_SHAPE,
    parity_num_requests=5,
    parity_max_prompt=20,
    parity_max_output=5,
    parity_preempt_block_size=4,
    kernel_block_sizes=(16,),
    kernel_head_dims=(64,),
    kernel_gqa=(1, 3),
    kernel_dtypes=("float32",),
    norm_hidden=(256, 100),
)


# ----------------------------------------------------------------------------------------------
# Report: JSON after every stage, markdown at the end


class Report:
    def __init__(self, out_dir: Path, budget_s: float) -> None:
        self.out_dir = out_dir
        self.started = time.perf_counter()
        self.deadline = self.started + budget_s
        self.data: dict[str, Any] = {"started_unix": time.time(), "budget_s": budget_s, "stages": {}}

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def until(self, cap_s: float, reserve_s: float = 0.0) -> float:
        """A deadline cap_s from now, but no later than reserve_s before the end of the budget
        (the time the stages after this one need)."""
        return min(time.perf_counter() + cap_s, self.deadline - reserve_s)

    def limits(self, cap_s: float, reserve_s: float = 0.0) -> RunLimits:
        """Run limits for a run that starts now and must end by until(cap_s, reserve_s)."""
        return limits_until(self.until(cap_s, reserve_s))

    def run_stage(self, name: str, fn: Callable[[], dict[str, Any]], min_seconds: float) -> None:
        if self.remaining() < min_seconds:
            self.data["stages"][name] = {"status": "skipped", "reason": "out of time budget"}
            print(f"[{name}] skipped: {self.remaining():.0f}s left, needs {min_seconds:.0f}s", flush=True)
            self.write()
            return
        print(f"[{name}] start ({self.remaining():.0f}s left)", flush=True)
        start = time.perf_counter()
        try:
            result = fn()
            status = "failed" if result.get("failures") else "skipped" if "skipped" in result else "ok"
            entry = {"status": status, **result}
        except Exception as exc:  # a broken stage must not hide the others' results
            entry = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            print(entry["traceback"], file=sys.stderr, flush=True)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        _release_memory()
        self.data["stages"][name] = entry
        print(f"[{name}] {entry['status']} in {entry['seconds']:.1f}s", flush=True)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.started, 2)
        (self.out_dir / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out_dir / "gpu_check.md").write_text(render_markdown(self.data))


def limits_until(deadline: float) -> RunLimits:
    """Run limits for a run that starts now and must end by `deadline` (perf_counter seconds)."""
    return RunLimits(drain_timeout_s=max(1.0, deadline - time.perf_counter()))


def _release_memory() -> None:
    """Free the stage's engines and models (CUDA graph pools included) before the next stage."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _rows(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> list[str]:
    if not rows:
        return ["(none)", ""]
    return [*markdown_table(columns, [[_cell(row.get(c)) for c in columns] for row in rows]), ""]


def render_markdown(data: dict[str, Any]) -> str:
    stages = data["stages"]
    env = stages.get("env", {})
    lines = [
        "# qworker GPU check",
        "",
        f"- device: {env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}; mode: {data.get('mode')}",
        f"- elapsed: {data.get('elapsed_s')} s of a {data.get('budget_s')} s budget",
        "",
    ]
    lines += _rows([{"stage": n, **s} for n, s in stages.items()], ["stage", "status", "seconds"])
    targets = data.get("targets", {})
    if targets:
        lines += ["## Targets", ""]
        lines += [
            f"- {name}: {_cell(t.get('value'))} (target {t['target']}) -> {t['verdict']}"
            for name, t in targets.items()
        ]
        lines.append("")
    for name, stage in stages.items():
        if stage.get("status") == "error":
            lines += [
                f"## {name}: error",
                "",
                "```",
                stage.get("traceback", stage.get("error", "")),
                "```",
                "",
            ]
        if stage.get("failures"):
            lines += [f"## {name}: failures", ""] + [f"- {f}" for f in stage["failures"]] + [""]
    kernels = stages.get("kernels", {})
    if kernels.get("cases"):
        lines += ["## Kernel correctness vs torch references", ""]
        lines += _rows(kernels["cases"], ["kernel", "case", "dtype", "max_abs_err", "atol", "ok"])
    bench = stages.get("bench", {})
    if bench.get("decode"):
        lines += [f"## Decode attention bandwidth (copy: {_cell(bench.get('copy_gbps'))} GB/s)", ""]
        lines += _rows(
            bench["decode"],
            ["batch", "context", "num_splits", "ms", "gbps", "fraction_of_copy", "fraction_of_hbm_peak",
             "best_num_splits"],
        )  # fmt: skip
        lines += ["### Other kernels", ""]
        lines += _rows(bench.get("elementwise", []), ["kernel", "ms", "gbps", "fraction_of_copy"])
        lines += _rows(bench.get("prefill", []), ["num_seqs", "prefix", "chunk", "ms", "tflops"])
    parity = stages.get("parity", {})
    if parity.get("checks"):
        lines += ["## Greedy parity (small fp32 model)", ""]
        lines += _rows(parity["checks"], ["check", "identical", "num_requests", "graph_runs", "preemptions"])
        lines += [f"- bf16, same model, graphs vs eager (informative): "
                  f"{parity.get('bf16_graphs_vs_eager_identical')} requests identical", ""]  # fmt: skip
    e2e = stages.get("e2e", {})
    if e2e.get("runs"):
        lines += ["## End to end: offline-mixed, Llama-3.2-1B shape, random weights", ""]
        lines += [f"- {k}: {_cell(v)}" for k, v in e2e.get("setup", {}).items()] + [""]
        lines += _rows(
            e2e["runs"],
            ["system", "num_prompts", "completed", "duration", "request_throughput", "output_throughput",
             "total_token_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_itl_ms",
             "p99_itl_ms", "num_graph_steps", "num_steps", "num_batches", "timed_out"],
        )  # fmt: skip
    if e2e.get("decode_steps"):
        lines += ["### Decode step time, CUDA graphs vs eager", ""]
        lines += _rows(e2e["decode_steps"], ["batch", "mode", "mean_tpot_ms", "output_throughput"])
    if e2e.get("graph_vs_eager_bf16"):
        lines += ["### Graphs vs eager, bf16 1B greedy tokens (informative: near-ties may flip)", ""]
        lines += [f"- {k}: {_cell(v)}" for k, v in e2e["graph_vs_eager_bf16"].items()] + [""]
    pytest_stage = stages.get("pytest", {})
    if pytest_stage.get("tail"):
        lines += ["## pytest tests/kernels (on the GPU)", "", "```", pytest_stage["tail"], "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Stage: env


def stage_env(sizes: Sizes) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    # The imports themselves are the check: the engine, and the bench modules this script runs.
    import qworker
    import qworker.bench.hf_generate
    import qworker.bench.qworker_engine
    import qworker.engine.llm_engine

    loaded = [m for m in FORBIDDEN_MODULES if m in sys.modules]
    result: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "qworker_from": str(Path(qworker.__file__).parent),
        "forbidden_modules_loaded": loaded,
    }
    if sizes.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        result.update(
            total_memory_gib=round(props.total_memory / 2**30, 1),
            num_sms=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
    if loaded:
        result["failures"] = [f"importing the engine and the bench loaded {loaded}"]
    return result


# ----------------------------------------------------------------------------------------------
# Stage: kernels


def stage_kernels(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch
    from qworker_kernels.testing import reference_checks

    deadline = report.until(90, reserve_s=300)  # mostly Triton compiles, one per shape and dtype
    cases: list[dict[str, Any]] = []
    failures: list[str] = []
    checks = reference_checks(
        sizes.device,
        dtypes=[getattr(torch, name) for name in sizes.kernel_dtypes],
        block_sizes=sizes.kernel_block_sizes,
        head_dims=sizes.kernel_head_dims,
        gqa_ratios=sizes.kernel_gqa,
        norm_hidden_sizes=sizes.norm_hidden,
    )
    for case in checks:
        cases.append(case.to_dict())
        if not case.ok:
            failures.append(case.describe_failure())
        if time.perf_counter() > deadline:
            failures.append("kernel checks cut short by the time budget")
            break
    return {"num_cases": len(cases), "num_failed": len(failures), "cases": cases, "failures": failures}


# ----------------------------------------------------------------------------------------------
# Stage: bench (runs scripts/bench_triton_kernels.py)


def stage_bench(sizes: Sizes, report: Report, out_dir: Path) -> dict[str, Any]:
    json_path = out_dir / "bench_kernels.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_triton_kernels.py"), "--json", str(json_path)]
    cmd += ["--interpret"] if sizes.device == "cpu" else ["--sweep-splits"]
    timeout = max(30.0, min(150.0, report.remaining() - 230))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    (out_dir / "bench_kernels.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        return {"failures": [f"bench exited {proc.returncode}: {proc.stderr[-2000:]}"]}
    data = json.loads(json_path.read_text())
    for row in data["decode"]:
        row["fraction_of_hbm_peak"] = row["gbps"] / HBM_PEAK_GBPS
    return {k: data[k] for k in ("copy_gbps", "decode", "prefill", "elementwise")}


# ----------------------------------------------------------------------------------------------
# Models, systems and runs (everything measured goes through qworker.bench)


def build_hf_model(shape: dict[str, Any], dtype: Any, device: Any, widen: float | None = None) -> Any:
    """A random Llama built in code; initialized on the device (fast for 1B parameters)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(device).eval()
    if widen is not None:  # near-uniform random logits make greedy picks near-ties; widen them
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(widen)
    return model


def engine_system(label: str, hf_model: Any, sizes: Sizes, graphs: bool, **overrides: Any) -> Any:
    """qworker's engine on the HF model's weights, continuous admission; `graphs`: decode steps
    replay CUDA graphs (on the CPU smoke run: the same padded buffers, uncaptured)."""
    from qworker.bench.qworker_engine import QworkerEngineSystem
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine

    args: dict[str, Any] = dict(model="random-llama", device=sizes.device, attention_backend="triton")
    args.update(overrides)
    config = EngineConfig(**args)
    engine = LLMEngine(config, hf_config=hf_model.config, state_dict=hf_model.state_dict())
    if graphs:
        engine.runner.enable_cuda_graphs(allow_cpu=sizes.device == "cpu")
    return QworkerEngineSystem(label, config, engine=engine)


def hf_system(label: str, hf_model: Any, batch_size: int, sizes: Sizes) -> System:
    from qworker.bench.hf_generate import HFGenerateSystem

    system = HFGenerateSystem(
        label, None, batch_size, dtype=hf_model.dtype, device=sizes.device, model=hf_model, pad_token_id=0
    )
    system.prepare()
    return system


def measure(
    system: System, requests: list[BenchRequest], limits: RunLimits
) -> tuple[dict[str, Any], RunResult]:
    """One run through the bench's loop; its row: vLLM bench-serve keys plus the system's counters."""
    result = run_system(system, requests, limits=limits, keep_token_ids=True)
    summary = summarize(result.records, result.duration_s, percentiles=PERCENTILES)
    row = {"system": system.label, **summary, **result.meta}
    return row, result


def token_lists(result: RunResult, requests: Sequence[BenchRequest]) -> list[list[int]]:
    assert result.token_ids is not None, "the run did not keep token ids"
    return [result.token_ids[r.request_id] for r in requests]


def uniform_requests(
    name: str, num_requests: int, vocab_size: int, prompt: tuple[int, int], output: tuple[int, int], seed: int
) -> list[BenchRequest]:
    """All at once, uniform prompt and output lengths: a workload spec through the bench's generator."""
    spec = parse_workload(
        {
            "name": name,
            "num_requests": num_requests,
            "prompt_len": {"dist": "uniform", "min": prompt[0], "max": prompt[1]},
            "output_len": {"dist": "uniform", "min": output[0], "max": output[1]},
            "seed": seed,
        }
    )
    return generate_requests(spec, vocab_size)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


# ----------------------------------------------------------------------------------------------
# Stage: parity (small fp32 model)


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
    deadline = report.until(90, reserve_s=180)
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


# ----------------------------------------------------------------------------------------------
# Stage: e2e (Llama-3.2-1B shape)


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
        kv_cache_memory_gb=sizes.e2e_kv_cache_gb,
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

    runs = []
    row, graph_result = measure(system, requests, report.limits(60, reserve_s=150))
    runs.append(row)
    # The same engine, eager (what enforce_eager=True builds), under its own name in the table.
    runner.disable_cuda_graphs()
    system.label = "qworker-eager"
    row, eager_result = measure(system, requests, report.limits(60, reserve_s=100))
    runs.append(row)

    # Decode step time at fixed batch sizes: short prompts, every step a pure decode after the first.
    decode_steps = []
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
            measure(system, decode_requests, report.limits(10, reserve_s=80))
            m, _ = measure(system, decode_requests, report.limits(10, reserve_s=80))
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
    _release_memory()
    engine_best = max(r["output_throughput"] for r in runs)
    hf_runs = []
    for batch_size in sizes.hf_batch_sizes:
        baseline = hf_system(f"hf-static-b{batch_size}", hf, batch_size, sizes)
        budget_s = max(15.0, min(60.0, (report.remaining() - 20) / len(sizes.hf_batch_sizes)))
        pace = run_system(baseline, requests[:batch_size], limits=RunLimits(drain_timeout_s=budget_s))
        num_batches = max(1, int(budget_s / max(pace.duration_s, 1e-3)))
        subset = requests[: num_batches * batch_size]
        row, _ = measure(baseline, subset, RunLimits(drain_timeout_s=2 * budget_s))
        hf_runs.append(row)
    runs += hf_runs
    hf_best = max(hf_runs, key=lambda r: r["output_throughput"])
    ratios = {
        f"output_throughput qworker-best / {r['system']}": _ratio(engine_best, r["output_throughput"])
        for r in hf_runs
    }
    ratios["output_throughput graphs / eager"] = _ratio(
        runs[0]["output_throughput"], runs[1]["output_throughput"]
    )
    return {
        "setup": setup,
        "runs": runs,
        "ratios": ratios,
        "best_engine_over_best_hf": _ratio(engine_best, hf_best["output_throughput"]),
        "decode_steps": decode_steps,
        "graph_vs_eager_bf16": graph_vs_eager,
        "failures": failures,
    }


# ----------------------------------------------------------------------------------------------
# Stage: pytest (optional)


def stage_pytest(report: Report) -> dict[str, Any]:
    import importlib.util

    missing = [m for m in ("pytest", "hypothesis") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"not installed: {missing}"}
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "kernels").glob("test_triton_*.py"))
    timeout = max(20.0, report.remaining() - 5)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"failures": [f"pytest timed out after {timeout:.0f}s"], "tail": out[-3000:]}
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {
        "returncode": proc.returncode,
        "tail": tail,
        "failures": [] if proc.returncode == 0 else ["pytest failed"],
    }


# ----------------------------------------------------------------------------------------------


def evaluate_targets(data: dict[str, Any]) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    bench = data["stages"].get("bench", {})
    row = next((r for r in bench.get("decode", []) if r["batch"] == 64 and r["context"] == 2048), None)
    if row is not None:
        targets["decode attention, batch 64 x ctx 2048, fraction of copy bandwidth"] = {
            "value": row["fraction_of_copy"],
            "target": ">= 0.70",
            "verdict": "met" if row["fraction_of_copy"] >= 0.70 else "NOT met",
        }
    e2e = data["stages"].get("e2e", {})
    if "best_engine_over_best_hf" in e2e:
        value = e2e["best_engine_over_best_hf"]
        targets["engine output throughput / best transformers static batching"] = {
            "value": value,
            "target": ">= 10x",
            "verdict": "met" if value >= 10 else "NOT met",
        }
    return targets


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", nargs="?", default="gpu_out", type=Path)
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1"
    )
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting work after this long")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: read when kernels are decorated
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device. Use --cpu-smoke for the CPU run of the same stages.", file=sys.stderr
        )
        return 2
    sizes = CPU_SMOKE_SIZES if args.cpu_smoke else GPU_SIZES
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {STAGES}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(args.out_dir, args.budget_s)
    report.data["mode"] = "cpu-smoke" if args.cpu_smoke else "gpu"
    report.data["sizes"] = sizes.__dict__
    plan: list[tuple[str, Callable[[], dict[str, Any]], float]] = [
        ("env", lambda: stage_env(sizes), 0),
        ("kernels", lambda: stage_kernels(sizes, report), 30),
        ("bench", lambda: stage_bench(sizes, report, args.out_dir), 60),
        ("parity", lambda: stage_parity(sizes, report), 45),
        ("e2e", lambda: stage_e2e(sizes, report), 90),
        ("pytest", lambda: {"skipped": "smoke mode"} if args.cpu_smoke else stage_pytest(report), 45),
    ]
    for name, fn, min_seconds in plan:
        if name in stages:
            report.run_stage(name, fn, min_seconds)
    report.data["targets"] = evaluate_targets(report.data)
    report.write()
    statuses = {name: stage["status"] for name, stage in report.data["stages"].items()}
    print(json.dumps({"statuses": statuses, "targets": report.data["targets"]}, indent=2))
    print(f"wrote {args.out_dir / 'gpu_check.json'} and {args.out_dir / 'gpu_check.md'}")
    return 0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
