"""One prepared check of the GPU path, for a machine with an NVIDIA GPU (run by scripts/gpu_check.sh).

Stages, each recorded in OUT/gpu_check.json (rewritten after every stage, so a kill keeps what
finished) and summarized in OUT/gpu_check.md:
  env      versions, device, and that the engine imports without pydantic, redis or boto3
  kernels  every Triton kernel against its plain-torch reference, on the acceptance shapes
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

Only torch, triton and transformers are needed. `--cpu-smoke` runs every stage with tiny sizes on
the CPU under TRITON_INTERPRET=1 (CUDA graphs there: the same padded static buffers, run eagerly).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HBM_PEAK_GBPS = 4800.0  # H200 datasheet: 4.8 TB/s
FORBIDDEN_MODULES = ("pydantic", "redis", "boto3")
STAGES = ("env", "kernels", "bench", "parity", "e2e", "pytest")

# A copy of ../shared/workloads/offline-mixed.json (shared/ may be absent on the GPU machine).
OFFLINE_MIXED = {
    "name": "offline-mixed",
    "num_requests": 128,
    "arrival": {"process": "all_at_once"},
    "prompt_len": {"dist": "uniform", "min": 32, "max": 512},
    "output_len": {"dist": "uniform", "min": 16, "max": 256},
    "shared_prefix_len": 0,
    "temperature": 0.0,
    "ignore_eos": True,
    "seed": 0,
}
# qworker.bench.workload skips the low (control) token ids in random prompts.
MIN_RANDOM_TOKEN_ID = 32

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


@dataclass
class Sizes:
    """Everything that differs between the GPU run and the CPU smoke run."""

    device: str
    e2e_dtype: str
    e2e_model: dict[str, Any]
    e2e_max_model_len: int
    e2e_kv_cache_gb: float
    e2e_num_requests: int
    e2e_prompt_len: tuple[int, int]
    e2e_output_len: tuple[int, int]
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
    e2e_prompt_len=(32, 512),
    e2e_output_len=(16, 256),
    e2e_max_num_seqs=256,
    e2e_max_num_batched_tokens=4096,
    hf_batch_sizes=(64, 256),
    decode_batches=(1, 32, 256),
    decode_prompt_len=128,
    decode_output_len=64,
    parity_model=dict(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
    parity_num_requests=48,
    parity_max_prompt=300,
    parity_max_output=40,
    kernel_block_sizes=(16, 32),
    kernel_head_dims=(64, 128),
    kernel_gqa=(1, 3, 8),
    kernel_dtypes=("bfloat16", "float16", "float32"),
    norm_hidden=(2048, 4096, 1000),
)

CPU_SMOKE_SIZES = Sizes(
    device="cpu",
    e2e_dtype="float32",
    e2e_model=dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    e2e_max_model_len=128,
    e2e_kv_cache_gb=0.01,
    e2e_num_requests=6,
    e2e_prompt_len=(4, 24),
    e2e_output_len=(2, 6),
    e2e_max_num_seqs=4,
    e2e_max_num_batched_tokens=32,
    hf_batch_sizes=(4,),
    decode_batches=(1, 3),
    decode_prompt_len=4,
    decode_output_len=3,
    parity_model=dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    parity_num_requests=5,
    parity_max_prompt=20,
    parity_max_output=5,
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


def _release_memory() -> None:
    """Free the stage's engines and models (CUDA graph pools included) before the next stage."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> list[str]:
    if not rows:
        return ["(none)", ""]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return [*lines, ""]


def render_markdown(data: dict[str, Any]) -> str:
    stages = data["stages"]
    lines = ["# qworker GPU check", ""]
    env = stages.get("env", {})
    lines += [
        f"- device: {env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}; mode: {data.get('mode')}",
        f"- elapsed: {data.get('elapsed_s')} s of a {data.get('budget_s')} s budget",
        "",
        "| stage | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {s.get('status')} | {_fmt(s.get('seconds'))} |" for n, s in stages.items()]
    lines.append("")
    targets = data.get("targets", {})
    if targets:
        lines += ["## Targets (issue 5)", ""]
        lines += [
            f"- {name}: {_fmt(t.get('value'))} (target {t['target']}) -> {t['verdict']}"
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
        lines += _table(kernels["cases"], ["kernel", "case", "dtype", "max_abs_err", "atol", "ok"])
    bench = stages.get("bench", {})
    if bench.get("decode"):
        lines += [f"## Decode attention bandwidth (copy: {_fmt(bench.get('copy_gbps'))} GB/s)", ""]
        lines += _table(
            bench["decode"],
            ["batch", "context", "num_splits", "ms", "gbps", "fraction_of_copy", "fraction_of_hbm_peak",
             "best_num_splits"],
        )  # fmt: skip
        lines += ["### Other kernels", ""]
        lines += _table(bench.get("elementwise", []), ["kernel", "ms", "gbps", "fraction_of_copy"])
        lines += _table(bench.get("prefill", []), ["num_seqs", "prefix", "chunk", "ms", "tflops"])
    parity = stages.get("parity", {})
    if parity.get("checks"):
        lines += ["## Greedy parity (small fp32 model)", ""]
        lines += _table(parity["checks"], ["check", "identical", "num_requests", "graph_runs", "preemptions"])
    e2e = stages.get("e2e", {})
    if e2e.get("runs"):
        lines += ["## End to end: offline-mixed, Llama-3.2-1B shape, random weights", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in e2e.get("setup", {}).items()] + [""]
        lines += _table(
            e2e["runs"],
            ["system", "completed", "duration_s", "request_throughput", "output_throughput",
             "total_token_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_itl_ms",
             "p99_itl_ms", "graph_steps", "steps", "partial"],
        )  # fmt: skip
    if e2e.get("decode_steps"):
        lines += ["### Decode step time, CUDA graphs vs eager", ""]
        lines += _table(e2e["decode_steps"], ["batch", "mode", "mean_tpot_ms", "output_throughput"])
    if e2e.get("graph_vs_eager_bf16"):
        lines += ["### Graphs vs eager, bf16 1B greedy tokens (informative: near-ties may flip)", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in e2e["graph_vs_eager_bf16"].items()] + [""]
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

    import qworker.engine.llm_engine  # noqa: F401  (the import itself is the check)

    loaded = [m for m in FORBIDDEN_MODULES if m in sys.modules]
    result: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
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
        result["failures"] = [f"importing the engine loaded {loaded}"]
    return result


# ----------------------------------------------------------------------------------------------
# Stage: kernels


TOLERANCES = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def stage_kernels(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch
    from qworker_kernels import triton_activation as act
    from qworker_kernels import triton_kv_cache as kv
    from qworker_kernels import triton_paged_attention as pa
    from qworker_kernels import triton_rmsnorm as rn
    from qworker_kernels import triton_rotary as rot

    device = torch.device(sizes.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    deadline = report.until(90, reserve_s=300)  # mostly Triton compiles, one per shape and dtype
    cases: list[dict[str, Any]] = []
    failures: list[str] = []

    def compare(kernel: str, case: str, dtype_name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        tol = TOLERANCES[dtype_name]
        diff = (got.float() - expected.float()).abs()
        has_nan = bool(got.isnan().any())
        max_err = float(diff.max()) if diff.numel() else 0.0
        ok = not has_nan and bool(torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol))
        cases.append(
            {
                "kernel": kernel,
                "case": case,
                "dtype": dtype_name,
                "max_abs_err": max_err,
                "atol": tol,
                "ok": ok,
            }
        )
        if not ok:
            failures.append(f"{kernel} {case} {dtype_name}: max_abs_err {max_err:.3g}, nan={has_nan}")

    def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    # -- paged attention: varlen (prefill chunks + decode rows) and split-K decode -------------
    for dtype_name in sizes.kernel_dtypes:
        dtype = getattr(torch, dtype_name)
        # The full grid in bf16 (the engine's dtype); other dtypes on the first shape only.
        grid = [
            (bs, hd, g)
            for bs in sizes.kernel_block_sizes
            for hd in sizes.kernel_head_dims
            for g in sizes.kernel_gqa
        ]
        if dtype_name != sizes.kernel_dtypes[0]:
            grid = grid[:1]
        for block_size, head_dim, gqa in grid:
            if time.perf_counter() > deadline:
                failures.append("attention checks cut short by the time budget")
                break
            num_kv_heads = 2
            num_heads = num_kv_heads * gqa
            # (cached prefix, query len): contexts of 1, one block, one block + 1, several
            # blocks; chunks of 1, 7 and 64 with and without a prefix.
            seqs = [
                (0, 1),
                (block_size - 1, 1),
                (block_size, 1),
                (3 * block_size + 5, 1),
                (0, 7),
                (block_size - 3, 7),
                (2 * block_size + 1, 64),
                (0, 64),
            ]
            batch = _paged_batch(seqs, block_size, head_dim, num_heads, num_kv_heads, dtype, device, gen)
            name = f"bs{block_size}_hd{head_dim}_gqa{gqa}"
            got = pa.paged_attention(*batch, max_query_len=64, max_seq_len=max(p + q for p, q in seqs))
            compare("paged_attention", name, dtype_name, got, pa.paged_attention_reference(*batch))
            decode_seqs = [(0, 1), (block_size - 1, 1), (block_size, 1), (999, 1), (5 * block_size + 2, 1)]
            q, k_cache, v_cache, block_tables, _, seq_lens, scale = _paged_batch(
                decode_seqs, block_size, head_dim, num_heads, num_kv_heads, dtype, device, gen
            )
            expected = pa.paged_decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
            # One split (the kernel writes out directly) and the automatic count (here 4: partial
            # results merged by the reduce kernel); each count is a separate compile.
            for num_splits in (None, 1):
                got = pa.paged_decode_attention(
                    q,
                    k_cache,
                    v_cache,
                    block_tables,
                    seq_lens,
                    scale,
                    num_splits=num_splits,
                    max_seq_len=1000,
                )
                compare("paged_decode_attention", f"{name}_splits{num_splits}", dtype_name, got, expected)

    # -- KV write (exact) ----------------------------------------------------------------------
    for dtype_name in sizes.kernel_dtypes:
        dtype = getattr(torch, dtype_name)
        num_blocks, block_size, kvh, hd, tokens = 12, 16, 8, 64, 37
        k, v = randn(tokens, kvh, hd, dtype=dtype), randn(tokens, kvh, hd, dtype=dtype)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(device)
        caches = [
            torch.zeros((num_blocks, block_size, kvh, hd), dtype=dtype, device=device) for _ in range(4)
        ]
        kv.write_kv_cache(k, v, caches[0], caches[1], slots)
        kv.write_kv_cache_reference(k, v, caches[2], caches[3], slots)
        exact = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        cases.append({"kernel": "write_kv_cache", "case": f"{tokens}tok", "dtype": dtype_name, "ok": exact})
        if not exact:
            failures.append(f"write_kv_cache {dtype_name}: caches differ from the reference")

    # -- RMSNorm, fused add + RMSNorm, SiLU-and-mul, rotary ------------------------------------
    for dtype_name in sizes.kernel_dtypes:
        dtype = getattr(torch, dtype_name)
        for hidden in sizes.norm_hidden:
            x, res, w = (
                randn(33, hidden, dtype=dtype),
                randn(33, hidden, dtype=dtype),
                randn(hidden, dtype=dtype),
            )
            compare(
                "rms_norm",
                f"h{hidden}",
                dtype_name,
                rn.rms_norm(x, w, 1e-5),
                rn.rms_norm_reference(x, w, 1e-5),
            )
            out, res_out = rn.fused_add_rms_norm(x, res, w, 1e-5)
            ref_out, ref_res = rn.fused_add_rms_norm_reference(x, res, w, 1e-5)
            compare("fused_add_rms_norm", f"h{hidden}", dtype_name, out, ref_out)
            compare("fused_add_rms_norm.residual", f"h{hidden}", dtype_name, res_out, ref_res)
            gate_up = randn(17, 2 * hidden, dtype=dtype)
            compare(
                "silu_and_mul",
                f"i{hidden}",
                dtype_name,
                act.silu_and_mul(gate_up),
                act.silu_and_mul_reference(gate_up),
            )
        # Rotary on strided q/k views of a fused qkv buffer, as the model calls it.
        tokens, nh, kvh, hd, max_pos = 29, 32, 8, 64, 4096
        qkv = randn(tokens, (nh + 2 * kvh) * hd, dtype=dtype)
        positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
        angles = torch.rand((max_pos, hd // 2), generator=gen).to(device) * 6.3
        cos, sin = angles.cos(), angles.sin()
        ref = qkv.clone()

        for buf, fn in ((qkv, rot.apply_rotary), (ref, rot.apply_rotary_reference)):
            q, k, _ = buf.split([nh * hd, kvh * hd, kvh * hd], dim=-1)
            fn(q.view(tokens, nh, hd), k.view(tokens, kvh, hd), positions, cos, sin)
        compare("apply_rotary", "strided_qkv", dtype_name, qkv, ref)
    return {"num_cases": len(cases), "num_failed": len(failures), "cases": cases, "failures": failures}


def _paged_batch(
    seqs: list[tuple[int, int]],
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: Any,
    device: Any,
    gen: Any,
) -> tuple[Any, ...]:
    """(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale) with blocks in a random
    order and NaN in every slot no sequence owns, so a masking bug shows up as NaN."""
    import torch

    blocks_per_seq = [-(-(p + q) // block_size) for p, q in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    physical = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros((len(seqs), max(blocks_per_seq) + 1), dtype=torch.int32)
    used = 0
    for s, ((prefix, query), n) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids = physical[used : used + n]
        used += n
        block_tables[s, :n] = ids.to(torch.int32)
        seq_len = prefix + query
        for pos in range(0, seq_len, block_size):
            count = min(block_size, seq_len - pos)
            block = int(ids[pos // block_size])
            k_cache[block, :count] = torch.randn((count, num_kv_heads, head_dim), generator=gen).to(dtype)
            v_cache[block, :count] = torch.randn((count, num_kv_heads, head_dim), generator=gen).to(dtype)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor([q for _, q in seqs]), 0)
    seq_lens = torch.tensor([p + q for p, q in seqs], dtype=torch.int32)
    q = torch.randn((int(query_start_loc[-1]), num_heads, head_dim), generator=gen).to(dtype)
    to = lambda t: t.to(device)
    return (
        to(q), to(k_cache), to(v_cache), to(block_tables), to(query_start_loc), to(seq_lens), head_dim**-0.5
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Stage: bench (reuses scripts/bench_triton_kernels.py)


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
# Workloads and runners


def offline_mixed_requests(
    num_requests: int,
    vocab_size: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request: the same draws as
    qworker.bench.workload.generate_requests on the offline-mixed spec (uniform lengths, one
    random stream each for prompt lengths, output lengths and prompt tokens)."""
    import numpy as np

    seeds = np.random.SeedSequence(seed).spawn(5)
    prompt_rng, output_rng, token_rng = (np.random.default_rng(s) for s in seeds[:3])
    allowed = np.arange(MIN_RANDOM_TOKEN_ID, vocab_size)
    prompt_lens = prompt_rng.integers(prompt_len[0], prompt_len[1], size=num_requests, endpoint=True)
    prompts = [allowed[token_rng.integers(0, len(allowed), size=int(n))].tolist() for n in prompt_lens]
    output_lens = output_rng.integers(output_len[0], output_len[1], size=num_requests, endpoint=True)
    return [(p, int(o)) for p, o in zip(prompts, output_lens, strict=True)]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _percentiles(prefix: str, values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None, f"p99_{prefix}_ms": None}
    ms = sorted(v * 1e3 for v in values_s)
    return {
        f"mean_{prefix}_ms": statistics.fmean(ms),
        f"median_{prefix}_ms": statistics.median(ms),
        f"p99_{prefix}_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
    }


def run_engine(
    engine: Any, requests: list[tuple[list[int], int]], deadline: float, label: str
) -> tuple[dict[str, Any], list[list[int]]]:
    """All requests at t=0, step to completion (or the deadline). vLLM bench-serve key names."""
    from qworker.engine.sampling_params import SamplingParams

    graphs = engine.runner.cuda_graphs
    graph_runs_before = graphs.num_runs if graphs is not None else 0
    steps_before = engine.num_steps
    start = time.perf_counter()
    ids = []
    for i, (prompt, out_len) in enumerate(requests):
        sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(f"{label}-{i}", {"prompt_token_ids": prompt}, sp))
    token_times: dict[str, list[float]] = {rid: [] for rid in ids}
    finished: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    partial = False
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            partial = True
            for rid in ids:
                if rid not in finished:
                    engine.abort(rid)
            break
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            token_times[out.request_id].extend([now] * len(out.new_token_ids))
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = now
    end = max(finished.values(), default=time.perf_counter())
    duration = end - start
    prompt_tokens = sum(len(p) for (p, _), rid in zip(requests, ids, strict=True) if rid in finished)
    output_tokens = sum(len(tokens[rid]) for rid in ids)
    ttft = [token_times[rid][0] - start for rid in ids if token_times[rid]]
    tpot = [
        (finished[rid] - token_times[rid][0]) / (len(token_times[rid]) - 1)
        for rid in finished
        if len(token_times[rid]) > 1
    ]
    itl = [b - a for rid in ids for a, b in zip(token_times[rid], token_times[rid][1:], strict=False)]
    e2el = [finished[rid] - start for rid in finished]
    metrics: dict[str, Any] = {
        "system": label,
        "completed": len(finished),
        "failed": len(ids) - len(finished),
        "duration_s": duration,
        "request_throughput": len(finished) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "total_output_tokens": output_tokens,
        **_percentiles("ttft", ttft),
        **_percentiles("tpot", tpot),
        **_percentiles("itl", itl),
        **_percentiles("e2el", e2el),
        "steps": engine.num_steps - steps_before,
        "graph_steps": (graphs.num_runs - graph_runs_before) if graphs is not None else 0,
        "partial": partial,
    }
    return metrics, [tokens[rid] for rid in ids]


def run_hf_static(
    hf_model: Any, requests: list[tuple[list[int], int]], batch_size: int, deadline: float, device: Any
) -> dict[str, Any]:
    """transformers generate with static batches: left-padded, greedy, each batch runs until its
    longest request is done; a request counts only its own output length."""
    import torch
    from transformers import StoppingCriteria

    class StopAtDeadline(StoppingCriteria):
        def __init__(self) -> None:
            self.num_steps = 0

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.num_steps += 1
            stop = time.perf_counter() > deadline
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    start = time.perf_counter()
    completed = prompt_tokens = output_tokens = 0
    e2el: list[float] = []
    partial = False
    for first in range(0, len(requests), batch_size):
        if time.perf_counter() > deadline:
            partial = True
            break
        batch = requests[first : first + batch_size]
        width = max(len(p) for p, _ in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        max_new = max(o for _, o in batch)
        stopper = StopAtDeadline()
        with torch.inference_mode():
            hf_model.generate(
                input_ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=0,
                stopping_criteria=[stopper],
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        generated = stopper.num_steps
        if generated < max_new:
            partial = True
        for prompt, out_len in batch:
            output_tokens += min(out_len, generated)
            if generated >= out_len:
                completed += 1
                prompt_tokens += len(prompt)
                e2el.append(now - start)
    duration = time.perf_counter() - start
    return {
        "system": f"hf-static-b{batch_size}",
        "completed": completed,
        "duration_s": duration,
        "request_throughput": completed / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "total_output_tokens": output_tokens,
        **_percentiles("e2el", e2el),
        "partial": partial,
    }


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


def build_engine(hf_model: Any, sizes: Sizes, **overrides: Any) -> Any:
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine

    args: dict[str, Any] = dict(model="random-llama", device=sizes.device, attention_backend="triton")
    args.update(overrides)
    return LLMEngine(EngineConfig(**args), hf_config=hf_model.config, state_dict=hf_model.state_dict())


def ensure_graphs(engine: Any) -> Any:
    """The engine's decode graphs; on the CPU (smoke run) the uncaptured twin is attached instead."""
    from qworker.engine.cuda_graphs import DecodeCudaGraphs

    if engine.runner.cuda_graphs is None and engine.device.type == "cpu":
        engine.runner.cuda_graphs = DecodeCudaGraphs(
            engine.model,
            engine.runner.kv_caches,
            engine.runner.backend,
            block_size=engine.config.block_size,
            max_model_len=engine.max_model_len,
            max_num_seqs=engine.config.max_num_seqs,
            padding_block_id=engine.padding_block_id,
            device=engine.device,
            capture=False,
        )
    assert engine.runner.cuda_graphs is not None, "CUDA graphs are off: enforce_eager or a non-Triton backend"
    return engine.runner.cuda_graphs


# ----------------------------------------------------------------------------------------------
# Stage: parity (small fp32 model)


def stage_parity(sizes: Sizes, report: Report) -> dict[str, Any]:
    import random

    import torch

    device = torch.device(sizes.device)
    hf = build_hf_model(sizes.parity_model, torch.float32, device, widen=3.0)
    rng = random.Random(0)
    vocab = sizes.parity_model["vocab_size"]
    requests = [
        ([rng.randrange(MIN_RANDOM_TOKEN_ID, vocab) for _ in range(rng.randint(1, sizes.parity_max_prompt))],
         rng.randint(2, sizes.parity_max_output))
        for _ in range(sizes.parity_num_requests)
    ]  # fmt: skip
    deadline = report.until(90, reserve_s=180)
    common = dict(dtype="float32", max_num_seqs=sizes.parity_num_requests, block_size=16)
    checks: list[dict[str, Any]] = []
    failures: list[str] = []

    def run(label: str, **overrides: Any) -> tuple[list[list[int]], Any]:
        args = {**common, **overrides}
        engine = build_engine(hf, sizes, **args)
        if overrides.get("attention_backend", "triton") == "triton" and not args.get("enforce_eager"):
            ensure_graphs(engine)
        metrics, tokens = run_engine(engine, requests, deadline, label)
        if metrics["partial"]:
            failures.append(f"{label}: stopped by the time budget, tokens cut short")
        return tokens, engine

    graphs_tokens, graphs_engine = run("triton-graphs")
    eager_tokens, eager_engine = run("triton-eager", enforce_eager=True)
    torch_tokens, _ = run("torch-backend", attention_backend="torch")
    chunked_tokens, chunked_engine = run(
        "triton-graphs-chunked-preempt",
        max_num_batched_tokens=max(8, min(64, sizes.parity_max_prompt // 2)),
        # Room for the longest request alone (plus slack), not for all: requests get preempted.
        num_kv_blocks=-(-(sizes.parity_max_prompt + sizes.parity_max_output) // 16) + 2,
    )
    if eager_engine.runner.cuda_graphs is not None:
        failures.append("enforce_eager=True still built CUDA graphs")
    hf_tokens = []
    for prompt, out_len in requests[:8]:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones((1, len(prompt)), dtype=torch.long, device=device),
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=0,
            )
        hf_tokens.append(out[0, len(prompt) :].tolist())

    def check(name: str, tokens: list[list[int]], reference: list[list[int]], engine: Any = None) -> None:
        identical = tokens == reference
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
    check("triton eager == torch backend", eager_tokens, torch_tokens, eager_engine)
    check("triton graphs == triton eager", graphs_tokens, eager_tokens, graphs_engine)
    check("triton graphs, chunked + preemption == eager", chunked_tokens, eager_tokens, chunked_engine)
    if not graphs_engine.runner.cuda_graphs.num_runs:
        failures.append("no decode step ran through the CUDA graphs")
    if not chunked_engine.scheduler.num_preemptions:
        failures.append("the preemption run did not preempt (KV pool too large)")
    return {"checks": checks, "graph_sizes": graphs_engine.runner.cuda_graphs.sizes, "failures": failures}


# ----------------------------------------------------------------------------------------------
# Stage: e2e (Llama-3.2-1B shape)


def stage_e2e(sizes: Sizes, report: Report) -> dict[str, Any]:
    import torch

    device = torch.device(sizes.device)
    dtype = getattr(torch, sizes.e2e_dtype)
    t = time.perf_counter()
    hf = build_hf_model(sizes.e2e_model, dtype, device)
    hf_build_s = time.perf_counter() - t
    t = time.perf_counter()
    engine = build_engine(
        hf,
        sizes,
        dtype=sizes.e2e_dtype,
        max_model_len=sizes.e2e_max_model_len,
        kv_cache_memory_gb=sizes.e2e_kv_cache_gb,
        max_num_seqs=sizes.e2e_max_num_seqs,
        max_num_batched_tokens=sizes.e2e_max_num_batched_tokens,
        block_size=16,
    )
    graphs = ensure_graphs(engine)
    engine_build_s = time.perf_counter() - t
    vocab = sizes.e2e_model["vocab_size"]
    requests = offline_mixed_requests(
        sizes.e2e_num_requests, vocab, sizes.e2e_prompt_len, sizes.e2e_output_len
    )
    setup: dict[str, Any] = {
        "model": "Llama-3.2-1B shape, random weights" if sizes.device == "cuda" else "tiny random Llama",
        "num_parameters": sum(p.numel() for p in hf.parameters()),
        "dtype": sizes.e2e_dtype,
        "num_requests": len(requests),
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": sum(o for _, o in requests),
        "kv_blocks": engine.num_kv_blocks,
        "max_num_seqs": sizes.e2e_max_num_seqs,
        "max_num_batched_tokens": sizes.e2e_max_num_batched_tokens,
        "graph_sizes": str(graphs.sizes),
        "hf_build_s": hf_build_s,
        "engine_build_s_with_graph_capture": engine_build_s,
    }
    failures: list[str] = []
    # Warm up: compiles the varlen and decode kernel variants outside the timed runs.
    run_engine(engine, [(p, 8) for p, _ in requests[:16]], report.until(30), "warmup")

    runs = []
    metrics, graph_tokens = run_engine(engine, requests, report.until(60, reserve_s=150), "qworker-graphs")
    runs.append(metrics)
    engine.runner.cuda_graphs = None  # the same engine, eager (what enforce_eager=True builds)
    metrics, eager_tokens = run_engine(engine, requests, report.until(60, reserve_s=100), "qworker-eager")
    runs.append(metrics)

    # Decode step time at fixed batch sizes: short prompts, every step a pure decode after the first.
    decode_steps = []
    for batch in sizes.decode_batches:
        prompt_len = (sizes.decode_prompt_len, sizes.decode_prompt_len)
        decode_requests = [
            (p, sizes.decode_output_len)
            for p, _ in offline_mixed_requests(batch, vocab, prompt_len, (1, 1), seed=1)
        ]
        for mode in ("graphs", "eager"):
            engine.runner.cuda_graphs = graphs if mode == "graphs" else None
            deadline = report.until(10, reserve_s=80)
            m, _ = run_engine(engine, decode_requests, deadline, f"decode-b{batch}-{mode}")
            decode_steps.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "mean_tpot_ms": m["mean_tpot_ms"],
                    "output_throughput": m["output_throughput"],
                }
            )
    engine.runner.cuda_graphs = graphs

    # bf16 greedy tokens, graphs vs eager, on the workload's requests. Not a pass/fail check: graph
    # replays pad the batch and fix the split count, so bf16 roundings differ and a random model's
    # near-tied logits may flip (the fp32 parity stage is the exact check).
    same = sum(a == b for a, b in zip(graph_tokens, eager_tokens, strict=True))
    agree = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(graph_tokens, eager_tokens, strict=True)
    ]
    graph_vs_eager = {
        "requests_identical": f"{same}/{len(requests)}",
        "mean_tokens_before_first_difference": statistics.fmean(agree) if agree else None,
    }

    # transformers generate, static batches, same GPU and requests (time-boxed: a prefix of them).
    del engine, graphs
    _release_memory()
    run_engine_best = max(r["output_throughput"] for r in runs)
    hf_runs = []
    with torch.inference_mode():  # warm up cuBLAS and the generate path
        hf.generate(torch.full((2, 8), 40, device=device), max_new_tokens=2, do_sample=False, pad_token_id=0)
    for batch_size in sizes.hf_batch_sizes:
        budget = max(15.0, min(60.0, (report.remaining() - 20) / len(sizes.hf_batch_sizes)))
        hf_runs.append(run_hf_static(hf, requests, batch_size, report.until(budget), device))
    runs += hf_runs
    for r in runs:
        if r["system"].startswith("qworker") and r["completed"] < len(requests):
            failures.append(f"{r['system']} completed {r['completed']} of {len(requests)} requests")
    hf_best = max(hf_runs, key=lambda r: r["output_throughput"])
    ratios = {
        f"output_throughput qworker-best / {r['system']}": _ratio(run_engine_best, r["output_throughput"])
        for r in hf_runs
    }
    ratios["output_throughput graphs / eager"] = _ratio(
        runs[0]["output_throughput"], runs[1]["output_throughput"]
    )
    return {
        "setup": setup,
        "runs": runs,
        "ratios": ratios,
        "best_engine_over_best_hf": _ratio(run_engine_best, hf_best["output_throughput"]),
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
