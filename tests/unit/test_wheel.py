"""The wheel is complete: built from the sources, installed without dependencies into a fresh
environment that reuses this test environment's packages (not a second torch) and does not see
the source tree, it runs `qworker --help`, a tiny offline generation, and its `qworker worker` on
one queued job. The last two share one interpreter (torch and qworker load once): the script
generates, then runs the installed console script as its command line would.

An editable install and the tests import qworker from the source tree, so a package left out of
pyproject's list (qworker.batch once was) shows only here. The build runs on a copy of the
sources, so that nothing is written into the working tree and no stale build/ folder of an
earlier layout leaks into the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from qworker.testing.worker_kit import write_tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
# What a wheel is built from (pyproject's readme included).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "qworker", "kernels")

# python generate_then_serve.py MODEL_DIR CONSOLE_SCRIPT ARGS...
GENERATE_THEN_SERVE = """
import json, runpy, sys
import qworker
from qworker import LLM, SamplingParams

llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=16, max_num_seqs=2)
outs = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
print(json.dumps({"qworker": qworker.__file__, "token_ids": outs[0].outputs[0].token_ids}), flush=True)
del llm
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")  # the console script ends with sys.exit(main())
"""


def run(cmd: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding the wheel of this tree; the test environment's packages on its path."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        if not (REPO / name).exists():
            continue
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(REPO / name, src / name)
    dist = root / "dist"
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src)], root)
    (wheel,) = dist.glob("qworker-*.whl")

    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root)
    python = venv / "bin" / "python"
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root
        ).stdout.strip()
    )
    # Plain path lines: the test environment's .pth files (its editable qworker) are not run.
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "test_environment.pth").write_text("".join(f"{p}\n" for p in paths))
    # --no-compile: the few modules the tests import are compiled on import, not all 300.
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", str(wheel)], root)
    return venv


def test_the_wheel_holds_every_package_and_data_file(installed, tmp_path):
    code = (
        "import json, qworker, qworker_kernels, qworker.batch, qworker.bench.workloads as w\n"
        "print(json.dumps([qworker.__file__, qworker_kernels.__file__]))\n"
    )
    done = run([str(installed / "bin" / "python"), "-c", code], tmp_path)
    qworker_file, kernels_file = (Path(p) for p in json.loads(done.stdout))
    assert installed in qworker_file.parents and installed in kernels_file.parents, (
        qworker_file,
        kernels_file,
    )
    package, kernels = qworker_file.parent, kernels_file.parent
    sources = {p.relative_to(REPO / "qworker") for p in (REPO / "qworker").rglob("*.py")}
    assert sources <= {p.relative_to(package) for p in package.rglob("*.py")}, (
        "modules missing from the wheel"
    )
    workloads = {p.name for p in (REPO / "qworker" / "bench" / "workloads").glob("*.json")}
    assert workloads and workloads <= {p.name for p in (package / "bench" / "workloads").glob("*.json")}
    c_sources = {p.name for p in (REPO / "kernels").iterdir() if p.suffix in (".py", ".c", ".h")}
    assert c_sources <= {p.name for p in kernels.iterdir()}, "kernel files missing from the wheel"


def test_the_installed_command_starts(installed, tmp_path):
    done = run([str(installed / "bin" / "qworker"), "--help"], tmp_path)
    for command in ("worker", "submit", "bench", "batch"):
        assert command in done.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def generated_then_served(installed, model_dir, tmp_path_factory):
    """GENERATE_THEN_SERVE with the wheel's `qworker worker --burst` on a queue holding one job:
    (the generation's JSON line, the job's result)."""
    from qworker.jobs.client import Client
    from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url

    tmp_path = tmp_path_factory.mktemp("generate-then-serve")
    script = tmp_path / "generate_then_serve.py"
    script.write_text(GENERATE_THEN_SERVE)
    url = unique_url(redis_base_url(), "wheel")
    client = Client(queue=url)
    job_id = client.submit({"prompt_token_ids": [1, 5, 9], "params": {"max_tokens": 4, "ignore_eos": True}})
    try:
        worker = [str(installed / "bin" / "qworker"), "worker", "--burst", "--queue", url]
        worker += [
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--num-kv-blocks",
            "16",
        ]
        done = run([str(installed / "bin" / "python"), str(script), str(model_dir), *worker], tmp_path)
        generated = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
        yield generated, client.result(job_id, timeout=10)
    finally:
        import redis

        cleanup(redis.Redis.from_url(url.split("?", 1)[0]), url)
        client.close()


def test_the_installed_package_generates_offline(installed, generated_then_served):
    generated, _ = generated_then_served
    assert installed in Path(generated["qworker"]).parents
    assert len(generated["token_ids"]) == 4


def test_the_installed_worker_serves_one_job_from_a_queue(generated_then_served):
    """The CPU image's install path end to end: the wheel's `qworker worker` takes a job from a
    Redis stream, stores its result, and exits (--burst)."""
    _, result = generated_then_served
    assert result.status == "completed", result.error
    assert len(result.token_ids) == 4
