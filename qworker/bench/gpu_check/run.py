"""The GPU check's plan: the stage registry (which stages run, in which order, each with its own
time limit on the GPU and on the CPU smoke run), and the verdict (0 when every stage is ok or
skipped). Stage modules import neither torch nor triton at module load (TRITON_INTERPRET is set
after this module is imported)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qworker.bench.gpu_check.cold_start import stage_cold_start
from qworker.bench.gpu_check.consistency import stage_consistency
from qworker.bench.gpu_check.e2e import stage_e2e
from qworker.bench.gpu_check.env import stage_env
from qworker.bench.gpu_check.invariance import stage_invariance
from qworker.bench.gpu_check.kernel_bench import stage_bench
from qworker.bench.gpu_check.kernels import stage_kernels
from qworker.bench.gpu_check.parity import stage_parity
from qworker.bench.gpu_check.profile import stage_profile
from qworker.bench.gpu_check.pytest_stage import stage_pytest
from qworker.bench.gpu_check.report import Report, evaluate_targets
from qworker.bench.gpu_check.roofline_stage import stage_roofline
from qworker.bench.gpu_check.serving import stage_serving
from qworker.bench.gpu_check.sizes import CPU_SMOKE_SIZES, GPU_SIZES, Sizes


@dataclass(frozen=True)
class StageContext:
    sizes: Sizes
    report: Report
    out_dir: Path
    # The checkout whose scripts and tests the bench and pytest stages run.
    repo: Path
    cpu_smoke: bool


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[StageContext], dict[str, Any]]
    # Seconds this stage may take on the GPU, and on the CPU smoke run (the interpreter is slow).
    limit_s: float
    smoke_limit_s: float


# In running order. The GPU limits add up to GPU_BUDGET_S: the whole check in 5 minutes.
REGISTRY: list[Stage] = [
    Stage("env", lambda c: stage_env(c.sizes), 10, 60),
    Stage("kernels", lambda c: stage_kernels(c.sizes, c.report), 25, 120),
    Stage("bench", lambda c: stage_bench(c.sizes, c.report, c.out_dir, c.repo), 20, 120),
    Stage("parity", lambda c: stage_parity(c.sizes, c.report), 20, 120),
    Stage("consistency", lambda c: stage_consistency(c.sizes, c.report), 15, 90),
    Stage("roofline", lambda c: stage_roofline(c.sizes, c.report), 30, 90),
    Stage("profile", lambda c: stage_profile(c.sizes, c.report, c.out_dir), 10, 60),
    Stage("e2e", lambda c: stage_e2e(c.sizes, c.report), 35, 120),
    Stage("serving", lambda c: stage_serving(c.sizes, c.report), 45, 180),
    Stage("cold_start", lambda c: stage_cold_start(c.sizes, c.report), 30, 120),
    # Several engine runs with CUDA graphs (64 prompts, probes alone, a small budget, cache hits).
    Stage("invariance", lambda c: stage_invariance(c.sizes, c.report), 30, 60),
    Stage(
        "pytest",
        lambda c: {"skipped": "smoke mode"} if c.cpu_smoke else stage_pytest(c.report, c.repo),
        30,
        5,
    ),
]
GPU_BUDGET_S = 300.0


def stage_names() -> tuple[str, ...]:
    return tuple(stage.name for stage in REGISTRY)


STAGES = stage_names()


def run_check(
    out_dir: Path, *, repo: Path, cpu_smoke: bool, budget_s: float | None, stages: Sequence[str]
) -> int:
    """Run `stages` (of STAGES, in registry order) into out_dir; budget_s None: the sum of the
    chosen stages' limits. TRITON_INTERPRET must already be set for a CPU smoke run."""
    unknown = sorted(set(stages) - set(stage_names()))
    assert not unknown, f"unknown stages {unknown}; choose from {stage_names()}"
    chosen = [stage for stage in REGISTRY if stage.name in stages]
    limits = {s.name: s.smoke_limit_s if cpu_smoke else s.limit_s for s in chosen}
    if budget_s is None:
        budget_s = sum(limits.values())
    sizes = CPU_SMOKE_SIZES if cpu_smoke else GPU_SIZES
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir, budget_s)
    report.data["mode"] = "cpu-smoke" if cpu_smoke else "gpu"
    report.data["sizes"] = sizes.__dict__
    report.data["stage_limits_s"] = limits
    context = StageContext(sizes=sizes, report=report, out_dir=out_dir, repo=repo, cpu_smoke=cpu_smoke)
    for stage in chosen:
        report.run_stage(stage.name, lambda stage=stage: stage.run(context), limits[stage.name])
    report.data["targets"] = evaluate_targets(report.data)
    report.write()
    statuses = {name: stage["status"] for name, stage in report.data["stages"].items()}
    print(json.dumps({"statuses": statuses, "targets": report.data["targets"]}, indent=2))
    print(f"wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}")
    return 0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1
