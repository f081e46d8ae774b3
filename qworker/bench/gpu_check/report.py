"""The GPU check's record: OUT/gpu_check.json rewritten after every stage (so that a kill keeps what
finished), OUT/gpu_check.md rendered from it, the time budget the stages share, and the targets."""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from qworker.bench.report import markdown_table
from qworker.bench.run import RunLimits


class StageTimeout(Exception):
    """Raised in the main thread by the stage watchdog when a stage passes its own time limit."""


# A stage's own runs aim to end this long before its limit; the watchdog fires at the limit.
STAGE_MARGIN_S = 3.0
# The watchdog waits this long again when it fires during a CUDA-graph capture.
CAPTURE_RETRY_S = 0.2


class Report:
    def __init__(self, out_dir: Path, budget_s: float) -> None:
        self.out_dir = out_dir
        self.started = time.perf_counter()
        self.deadline = self.started + budget_s
        # The running stage's own end (perf_counter seconds); the whole budget between stages.
        self.stage_deadline = self.deadline
        # What the running stage has measured so far: kept in its entry if it times out.
        self.partial: dict[str, Any] = {}
        self.data: dict[str, Any] = {"started_unix": time.time(), "budget_s": budget_s, "stages": {}}

    def remaining(self) -> float:
        """Seconds left to the running stage (its limit less a margin, within the budget)."""
        return min(self.stage_deadline, self.deadline) - time.perf_counter()

    def until(self, cap_s: float) -> float:
        """A deadline cap_s from now, but no later than the running stage's end."""
        return min(time.perf_counter() + cap_s, self.stage_deadline, self.deadline)

    def limits(self, cap_s: float) -> RunLimits:
        """Run limits for a run that starts now and must end by until(cap_s)."""
        return limits_until(self.until(cap_s))

    def run_stage(self, name: str, fn: Callable[[], dict[str, Any]], limit_s: float) -> None:
        """Run one stage under its own limit (and within what is left of the budget). A stage past
        its limit is stopped by SIGALRM in the main thread and recorded as "timed out" with what
        it put in `self.partial`; the next stage then starts. Python code stops at once; a CUDA
        kernel or a child process in progress is waited for or killed (subprocess.run kills it)."""
        left = self.deadline - time.perf_counter()
        limit = min(limit_s, left)
        if limit < min(10.0, limit_s):
            self.data["stages"][name] = {
                "status": "skipped",
                "reason": "out of time budget",
                "limit_s": limit_s,
            }
            print(
                f"[{name}] skipped: {left:.0f}s of the budget left, its limit is {limit_s:.0f}s", flush=True
            )
            self.write()
            return
        print(f"[{name}] start (limit {limit:.0f}s, {left:.0f}s of the budget left)", flush=True)
        start = time.perf_counter()
        self.stage_deadline = start + max(1.0, limit - STAGE_MARGIN_S)
        self.partial = {}
        try:
            with _watchdog(limit):
                result = fn()
            status = "failed" if result.get("failures") else "skipped" if "skipped" in result else "ok"
            entry = {"status": status, **result}
        except StageTimeout:
            entry = {"status": "timed out", **self.partial}
            entry.setdefault("failures", []).append(f"stopped at its {limit:.0f}s limit")
        except Exception as exc:  # a broken stage must not hide the others' results
            entry = {
                "status": "error",
                **self.partial,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            print(entry["traceback"], file=sys.stderr, flush=True)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        entry["limit_s"] = round(limit, 1)
        self.stage_deadline = self.deadline
        self.partial = {}
        release_memory()
        self.data["stages"][name] = entry
        print(f"[{name}] {entry['status']} in {entry['seconds']:.1f}s", flush=True)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.started, 2)
        (self.out_dir / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out_dir / "gpu_check.md").write_text(render_markdown(self.data))


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """Raise StageTimeout in the main thread after `seconds` (SIGALRM); a no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # An exception inside a CUDA-graph capture would leave the device unusable for the
            # stages after this one: try again when the capture (a fraction of a second) is over.
            signal.setitimer(signal.ITIMER_REAL, CAPTURE_RETRY_S)
            return
        raise StageTimeout

    previous = signal.signal(signal.SIGALRM, fire)
    # An outer timer (pytest-timeout's, say) is put back afterwards with what was left of it.
    outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:
            left = max(0.01, outer_delay - (time.monotonic() - started))
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


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
        "- versions: the device's own installs (the check installs no torch); the project pins torch "
        "2.13 for its CPU machines",
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
             "best_num_splits", "wave_num_splits", "wave_ms", "wave_speedup"],
        )  # fmt: skip
        lines += ["### Other kernels", ""]
        lines += _rows(bench.get("elementwise", []), ["kernel", "ms", "gbps", "fraction_of_copy"])
        lines += ["### write_kv_cache by launch variant (QWORKER_KV_WRITE)", ""]
        lines += _rows(
            bench.get("kv_write", []),
            [
                "tokens",
                "variant",
                "ms",
                "gbps",
                "fraction_of_copy",
                "same_bytes_copy_ms",
                "over_same_bytes_copy",
            ],
        )
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
    lines += _render_new_stages(stages)
    pytest_stage = stages.get("pytest", {})
    if pytest_stage.get("tail"):
        lines += ["## pytest tests/kernels (on the GPU)", "", "```", pytest_stage["tail"], "```", ""]
    return "\n".join(lines)


def _render_new_stages(stages: dict[str, Any]) -> list[str]:
    """The roofline, profile, consistency and serving stages' sections."""
    lines: list[str] = []
    roof = stages.get("roofline", {})
    if roof.get("rows"):
        lines += [
            f"## Decode step against its roofline (copy {_cell(roof.get('copy_gbps'))} GB/s, "
            f"matmul {_cell(roof.get('matmul_tflops'))} TFLOP/s, measured in this run)",
            "",
        ]
        lines += _rows(
            roof["rows"],
            ["batch", "context", "step_ms", "replay_ms", "logits_ms", "eager_ms", "weight_bytes",
             "kv_read_bytes", "gflops", "floor_ms", "serial_ms", "binding", "fraction_of_floor"],
        )  # fmt: skip
        lines += ["### Candidate switches, A/B on the same steps (speedup > 1: the candidate is faster)", ""]
        lines += _rows(
            roof.get("ab", []), ["variant", "batch", "context", "step_ms", "baseline_ms", "speedup"]
        )
    profile = stages.get("profile", {})
    for mode, top in profile.get("top", {}).items():
        lines += [
            f"## Profile, {mode}, batch {profile.get('batch')} x ctx {profile.get('context')} (self time)",
            "",
        ]
        lines += _rows(top, ["name", "calls", "self_us"])
    consistency = stages.get("consistency", {})
    if consistency.get("rows"):
        lines += ["## Padded graph replays vs eager, bit for bit", ""]
        lines += [f"- {line}" for line in consistency.get("diagnosis", [])] + [""]
        lines += _rows(
            consistency["rows"],
            ["model", "dtype", "batch", "padded_to", "graph_vs_eager_bit_equal", "graph_vs_eager_max_abs",
             "graph_vs_eager_tokens_equal", "capture_bit_equal", "padding_bit_equal", "splits_bit_equal"],
        )  # fmt: skip
    serving = stages.get("serving", {})
    columns = [
        "system", "num_prompts", "completed", "duration", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
    ]  # fmt: skip
    if serving.get("runs"):
        lines += ["## Serving through the engine (qworker.bench run loop), CUDA graphs", ""]
        lines += _rows(serving["runs"], columns)
        lines += [f"- {k}: {_cell(v)}" for k, v in serving.get("ratios", {}).items()] + [""]
    if serving.get("poisson"):
        lines += ["### online-poisson, rate raised until p99 TTFT > 2 s", ""]
        lines += _rows(serving["poisson"], ["rate", *columns[1:]])
    return lines


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
    for verdict in data["stages"].get("roofline", {}).get("limits", []):
        targets[f"decode step batch {verdict['batch']} x ctx {verdict['context']}, times its floor"] = {
            "value": verdict["over_floor"],
            "target": f"<= {verdict['limit']}x",
            "verdict": "met" if verdict["met"] else "NOT met",
        }
    for row in bench.get("kv_write", []):
        if row["tokens"] >= 64 and row["variant"] == "token":
            targets[f"write_kv_cache {row['tokens']} tokens, fraction of copy bandwidth"] = {
                "value": row["fraction_of_copy"],
                "target": ">= 0.70",
                "verdict": "met" if row["fraction_of_copy"] >= 0.70 else "NOT met",
            }
    serving = data["stages"].get("serving", {})
    if "nano_vllm_output_throughput" in serving:
        value = serving["nano_vllm_output_throughput"]
        targets["nano-vllm protocol output tok/s"] = {
            "value": value,
            "target": ">= 25000",
            "verdict": "met" if value >= 25000 else "NOT met",
        }
    caching = serving.get("ratios", {}).get("shared-prefix output throughput caching on / off")
    if caching is not None:
        targets["shared-prefix output throughput, caching on / off"] = {
            "value": caching,
            "target": ">= 3x",
            "verdict": "met" if caching >= 3 else "NOT met",
        }
    return targets
