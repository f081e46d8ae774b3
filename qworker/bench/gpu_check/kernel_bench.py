"""Stage bench: scripts/bench_triton_kernels.py in a subprocess (decode attention bandwidth vs HBM
peak and vs a device-to-device copy measured in the same run, batch 1/16/64/256 x ctx
512/2048/8192; the other kernels)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from qworker.bench.gpu_check.report import Report
from qworker.bench.gpu_check.sizes import Sizes

HBM_PEAK_GBPS = 4800.0  # H200 datasheet: 4.8 TB/s


def stage_bench(sizes: Sizes, report: Report, out_dir: Path, repo: Path) -> dict[str, Any]:
    """`repo`: the checkout whose scripts/bench_triton_kernels.py runs."""
    json_path = out_dir / "bench_kernels.json"
    cmd = [sys.executable, str(repo / "scripts" / "bench_triton_kernels.py"), "--json", str(json_path)]
    cmd += ["--interpret"] if sizes.device == "cpu" else ["--sweep-splits"]
    timeout = max(5.0, report.remaining())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=repo)
    (out_dir / "bench_kernels.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        return {"failures": [f"bench exited {proc.returncode}: {proc.stderr[-2000:]}"]}
    data = json.loads(json_path.read_text())
    for row in data["decode"]:
        row["fraction_of_hbm_peak"] = row["gbps"] / HBM_PEAK_GBPS
    return {k: data[k] for k in ("copy_gbps", "decode", "prefill", "elementwise", "kv_write")}
