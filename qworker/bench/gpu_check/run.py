"""The GPU check's plan: which stages run, in which order, with how much of the time budget each
needs at least; the verdict (0 when every stage is ok or skipped)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qworker.bench.gpu_check.cold_start import stage_cold_start
from qworker.bench.gpu_check.e2e import stage_e2e
from qworker.bench.gpu_check.env import stage_env
from qworker.bench.gpu_check.kernel_bench import stage_bench
from qworker.bench.gpu_check.kernels import stage_kernels
from qworker.bench.gpu_check.parity import stage_parity
from qworker.bench.gpu_check.pytest_stage import stage_pytest
from qworker.bench.gpu_check.report import Report, evaluate_targets
from qworker.bench.gpu_check.sizes import CPU_SMOKE_SIZES, GPU_SIZES

STAGES = ("env", "kernels", "bench", "parity", "e2e", "cold_start", "pytest")


def run_check(out_dir: Path, *, repo: Path, cpu_smoke: bool, budget_s: float, stages: Sequence[str]) -> int:
    """Run `stages` (of STAGES) into out_dir; `repo` is the checkout whose scripts and tests the
    bench and pytest stages run. TRITON_INTERPRET must already be set for a CPU smoke run."""
    unknown = sorted(set(stages) - set(STAGES))
    assert not unknown, f"unknown stages {unknown}; choose from {STAGES}"
    sizes = CPU_SMOKE_SIZES if cpu_smoke else GPU_SIZES
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir, budget_s)
    report.data["mode"] = "cpu-smoke" if cpu_smoke else "gpu"
    report.data["sizes"] = sizes.__dict__
    plan: list[tuple[str, Callable[[], dict[str, Any]], float]] = [
        ("env", lambda: stage_env(sizes), 0),
        ("kernels", lambda: stage_kernels(sizes, report), 30),
        ("bench", lambda: stage_bench(sizes, report, out_dir, repo), 60),
        ("parity", lambda: stage_parity(sizes, report), 45),
        ("e2e", lambda: stage_e2e(sizes, report), 90),
        ("cold_start", lambda: stage_cold_start(sizes, report), 60),
        ("pytest", lambda: {"skipped": "smoke mode"} if cpu_smoke else stage_pytest(report, repo), 45),
    ]
    for name, fn, min_seconds in plan:
        if name in stages:
            report.run_stage(name, fn, min_seconds)
    report.data["targets"] = evaluate_targets(report.data)
    report.write()
    statuses = {name: stage["status"] for name, stage in report.data["stages"].items()}
    print(json.dumps({"statuses": statuses, "targets": report.data["targets"]}, indent=2))
    print(f"wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}")
    return 0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1
