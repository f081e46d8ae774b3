"""Stage pytest: tests/kernels/test_triton_*.py on the GPU, when pytest and hypothesis are installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

from qworker.bench.gpu_check.report import Report


def stage_pytest(report: Report, repo: Path) -> dict[str, Any]:
    """`repo`: the checkout whose tests/kernels run."""
    missing = [m for m in ("pytest", "hypothesis") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"not installed: {missing}"}
    files = sorted(str(p.relative_to(repo)) for p in (repo / "tests" / "kernels").glob("test_triton_*.py"))
    timeout = max(5.0, report.remaining())
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=repo)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"failures": [f"pytest timed out after {timeout:.0f}s"], "tail": out[-3000:]}
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {
        "returncode": proc.returncode,
        "tail": tail,
        "failures": [] if proc.returncode == 0 else ["pytest failed"],
    }
