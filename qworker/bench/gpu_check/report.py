"""The GPU check's record: OUT/gpu_check.json rewritten after every stage (so that a kill keeps what
finished), OUT/gpu_check.md rendered from it, the time budget the stages share, and the targets."""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qworker.bench.report import markdown_table
from qworker.bench.run import RunLimits


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
        release_memory()
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


def release_memory() -> None:
    """Free the stage's engines and models (CUDA graph pools included) before the next stage."""
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
