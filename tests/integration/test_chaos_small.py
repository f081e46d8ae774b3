"""The chaos soak, small: 300 short jobs on 2 worker processes and a private Redis (AOF on),
a worker SIGKILLed and one SIGTERMed (each restarted) and Redis killed and restarted once; every
job ends with exactly one result, nothing pending, no dead letters, bounded memory growth.
scripts/chaos_soak.py runs the same with 10,000 jobs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_chaos_small(tiny_model_dir, tmp_path):
    out = tmp_path / "soak"
    args = [
        sys.executable,
        str(REPO / "scripts" / "chaos_soak.py"),
        "--num-jobs", "300",
        "--rate", "10",
        "--burst-every-s", "10",
        "--burst-size", "50",
        "--chaos-every-s", "6",
        "--warmup-s", "20",
        "--sample-every-s", "5",
        "--timeout-s", "300",
        "--seed", "3",
        "--out", str(out),
        "--model-dir", str(tiny_model_dir),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(args, capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"] == 300 and summary["lost"] == 0 and summary["duplicated"] == 0
    assert summary["pending"] == 0 and summary["dead_letters"] == 0
    assert summary["redis_restarts"] == 1
    assert summary["worker_kills"] + summary["worker_terms"] >= 1, output[-3000:]
    assert (out / "memory.png").stat().st_size > 0
