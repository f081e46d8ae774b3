"""Dependencies point down: the engine never imports the worker's libraries, and the worker's
seam to the engine, its loop and its in-memory test parts never import torch.

Each check imports in a fresh interpreter, so that what other tests imported does not count; the
two worker-side checks share one, which imports the smaller set first and answers for it before
importing the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER_LIBRARIES = ("pydantic", "redis", "boto3", "botocore", "kombu", "celery")
ENGINE_LIBRARIES = ("torch", "transformers", "triton")


def imported_in_turn(steps: list[tuple[list[str], tuple[str, ...]]]) -> list[list[str]]:
    """For each step in turn, in one new process: the `watched` top-level packages in sys.modules
    after importing the step's `modules` (and those of the steps before it)."""
    code = (
        "import importlib, json, sys\n"
        f"for modules, watched in {steps!r}:\n"
        "    for name in modules:\n"
        "        importlib.import_module(name)\n"
        "    print(json.dumps(sorted(m for m in watched if m in sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(steps) :]]


BACKEND_LIBRARIES = ("redis", "boto3", "botocore", "kombu", "celery")
# The worker side's modules; qworker.backends.connections alone comes first, so that one process
# answers both checks: what connections pulls in, then what all of them do.
CONNECTIONS = ["qworker.backends.connections"]
WORKER_SIDE = [
    "qworker.worker.engine_protocol",
    "qworker.worker.loop",
    "qworker.testing.fake_engine",
    "qworker.backends.memory.queue",
    "qworker.backends.memory.results",
]


@pytest.fixture(scope="module")
def worker_side_imports() -> list[list[str]]:
    """[backend libraries after connections, engine libraries after connections and WORKER_SIDE]"""
    return imported_in_turn([(CONNECTIONS, BACKEND_LIBRARIES), (WORKER_SIDE, ENGINE_LIBRARIES)])


@pytest.mark.timeout(150)
def test_engine_imports_no_worker_library():
    modules = ["qworker", "qworker.engine.llm_engine", "qworker.engine.llm"]
    (loaded,) = imported_in_turn([(modules, WORKER_LIBRARIES)])
    assert loaded == [], f"the engine pulled in {loaded}: it must run with torch and transformers alone"


@pytest.mark.timeout(150)
def test_worker_loop_and_its_test_parts_import_no_torch(worker_side_imports):
    loaded = worker_side_imports[1]
    assert loaded == [], f"the worker side pulled in {loaded}: the worker never touches tensors"


@pytest.mark.timeout(150)
def test_connections_open_backends_lazily(worker_side_imports):
    # The table names modules; nothing of a backend's client library loads until a URL uses it.
    loaded = worker_side_imports[0]
    assert loaded == []


MYPY_SKIPPED = (
    "transformers",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    "matplotlib",
    "fastapi",
    "starlette",
    "PIL",
    "rich",
    "torch",
    "numpy",
    "triton",
    "sympy",
    "pydantic",
    "pydantic_core",
    "prometheus_client",
    "llguidance",
)
# Of torch, only the modules that define the types a protocol member can name: `torch.device`
# (torch._C), `torch.dtype`, `torch.Tensor`, and the stub of torch's functions that
# fake_engine.py calls (`torch.tensor`). The whole of torch was 80% of a cold run (18 s of 22 s
# CPU); these few are under 2 s. The probe below proves that torch's types stay real.
MYPY_FOLLOWED = ("torch", "torch._C", "torch._C._VariableFunctions", "torch._tensor", "torch.types")

# A module mypy must reject: if torch's types became Any (a module of torch skipped that defines
# them), this would pass and the check of `device` would mean nothing.
DEVICE_PROBE = """
import torch

from qworker.worker.engine_protocol import DeviceLike


def a_device_is_device_like(d: torch.device) -> DeviceLike:
    return d


def a_dtype_is_not(d: torch.dtype) -> DeviceLike:
    return d


def a_tensor_is_not(d: torch.Tensor) -> DeviceLike:
    return d
"""


@pytest.mark.timeout(280)
def test_engines_satisfy_the_engine_protocol(request, tmp_path):
    """Static, by mypy: engine_protocol.py returns an LLMEngine and a FakeEngine as an
    EngineProtocol, and the loop uses the engine only through the protocol."""
    import mypy  # noqa: F401  (a dev dependency: the check must run, not skip)

    # pytest's cache keeps mypy's between runs (a fresh CI checkout runs it cold). Libraries whose
    # types never reach a protocol member are skipped (their names are Any): transformers alone
    # was over half of a cold run (3,700 modules). Stubs (.pyi) are followed whatever
    # follow_imports says unless follow_imports_for_stubs is set: without it (and with pydantic,
    # prometheus_client and llguidance followed) a cold run parsed 553 modules, 107 of them
    # numpy's stubs, in 8.6 s CPU; with it, 276 modules in 3.9 s.
    cache = getattr(request.config, "cache", None)
    cache_dir = cache.mkdir("mypy") if cache is not None else tmp_path
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\nfollow_imports = silent\nignore_missing_imports = True\n\n"
        f"[mypy-{','.join(f'{name}.*' for name in MYPY_SKIPPED)}]\n"
        "follow_imports = skip\nfollow_imports_for_stubs = True\n\n"
        f"[mypy-{','.join(MYPY_FOLLOWED)}]\nfollow_imports = silent\n"
    )
    probe = tmp_path / "qworker_device_probe.py"
    probe.write_text(DEVICE_PROBE)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--cache-dir",
            str(cache_dir),
            "qworker/worker/engine_protocol.py",
            "qworker/worker/loop.py",
            "qworker/testing/fake_engine.py",
            str(probe),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    errors = [line for line in done.stdout.splitlines() if ": error: " in line]
    theirs = [line for line in errors if probe.name not in line]
    assert not theirs and done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    # The probe's two wrong returns, and only those: torch.device, dtype and Tensor are real types.
    lines = DEVICE_PROBE.splitlines()
    expected = {i + 2 for i, line in enumerate(lines) if line.startswith("def a_") and "_is_not" in line}
    assert {int(line.split(":")[1]) for line in errors} == expected, done.stdout[-4000:]
