"""The GPU check's stage plan: each stage's own time limit (a stage past it is recorded as "timed
out" with what it measured, and the next one starts), the 5-minute GPU budget, --stages
selection, and the scaled serving workloads. Nothing here needs torch or a GPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from qworker.bench.gpu_check import run as gpu_run
from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.serving import scaled
from qworker.bench.gpu_check.sizes import CPU_SMOKE_SIZES, GPU_SIZES

pytestmark = pytest.mark.timeout(60)


def test_a_stage_past_its_limit_times_out_and_the_next_one_runs(tmp_path: Path) -> None:
    report = Report(tmp_path, budget_s=60)

    def slow() -> dict:
        report.partial["rows"] = [1, 2]  # measured before the limit: kept
        while True:
            time.sleep(0.05)

    started = time.perf_counter()
    report.run_stage("slow", slow, limit_s=1.0)
    assert time.perf_counter() - started < 5
    report.run_stage("next", lambda: {"value": 3}, limit_s=5.0)
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert stages["slow"]["status"] == "timed out"
    assert stages["slow"]["rows"] == [1, 2]
    assert "limit" in stages["slow"]["failures"][0]
    assert stages["next"]["status"] == "ok" and stages["next"]["value"] == 3
    assert stages["next"]["limit_s"] == 5.0


def test_a_stage_sees_its_own_deadline_and_the_budget_caps_it(tmp_path: Path) -> None:
    report = Report(tmp_path, budget_s=30)
    seen = {}

    def look() -> dict:
        seen["remaining"] = report.remaining()
        return {}

    report.run_stage("short", look, limit_s=10.0)
    assert 5.0 < seen["remaining"] <= 10.0  # the stage's limit less a margin, not the 30 s budget
    report.deadline = time.perf_counter() + 2.0  # what is left of the budget is less than a limit
    report.run_stage("capped", look, limit_s=10.0)
    assert report.data["stages"]["capped"]["status"] == "skipped"


def test_gpu_stage_limits_fit_five_minutes_and_every_stage_has_one() -> None:
    names = gpu_run.stage_names()
    assert len(set(names)) == len(names)
    assert {"env", "kernels", "roofline", "profile", "consistency", "serving", "pytest"} <= set(names)
    assert sum(s.limit_s for s in gpu_run.REGISTRY) <= gpu_run.GPU_BUDGET_S == 300.0
    assert all(s.limit_s > 0 and s.smoke_limit_s > 0 for s in gpu_run.REGISTRY)


def test_chosen_stages_run_in_registry_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = []
    fake = [
        gpu_run.Stage(name, lambda c, name=name: ran.append(name) or {}, 5, 5) for name in ("a", "b", "c")
    ]
    monkeypatch.setattr(gpu_run, "REGISTRY", fake)
    code = gpu_run.run_check(tmp_path, repo=tmp_path, cpu_smoke=True, budget_s=None, stages=["c", "a"])
    assert code == 0 and ran == ["a", "c"]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["budget_s"] == 10 and data["stage_limits_s"] == {"a": 5, "c": 5}


def test_serving_workloads_are_scaled() -> None:
    shared = scaled("shared-prefix", GPU_SIZES.shared_prefix_num_requests, GPU_SIZES, vocab=1000)
    assert len(shared) == 1024
    prefix = shared[0].prompt_token_ids[:512]
    assert all(r.prompt_token_ids[:512] == prefix for r in shared)
    poisson = scaled("online-poisson", 40, GPU_SIZES, vocab=1000, rate=100.0)
    assert len(poisson) == 40 and 0.1 < poisson[-1].arrival_s < 1.5  # 40 arrivals at 100/s
    smoke = scaled("shared-prefix", 6, CPU_SMOKE_SIZES, vocab=256)
    assert all(r.prompt_len + r.output_len <= CPU_SMOKE_SIZES.e2e_max_model_len for r in smoke)
