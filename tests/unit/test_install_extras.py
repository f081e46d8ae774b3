"""The command starts on each install a user can make: the base install (a producer), the base plus
`[gateway]` (the gateway image), and the base plus `[engine]` (which must say in one line that the
gateway needs `[gateway]`).

Each install is a fresh venv whose site-packages holds links to exactly the distributions that
install would bring: the requirements of pyproject.toml and their own, read from the metadata
installed here (`importlib.metadata`), so nothing is downloaded and a venv costs milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def closure(requirements: list[str]) -> dict[str, Distribution]:
    """The installed distributions that `requirements` need, their dependencies included."""
    found: dict[str, Distribution] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        requirement, parent_extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": parent_extra}):
            continue
        name = canonicalize_name(requirement.name)
        for extra in ("", *requirement.extras):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            try:
                dist = found.setdefault(name, distribution(name))
            except PackageNotFoundError:
                pytest.fail(f"{name} is required but not installed here")
            for dependency in dist.requires or []:
                parsed = Requirement(dependency)
                if extra and parsed.marker is None:
                    continue  # a plain dependency: taken with the "" pass
                todo.append((parsed, extra))
    return found


def make_venv(root: Path, requirements: list[str]) -> Path:
    """A venv at `root` whose site-packages links the distributions of `requirements` and qworker
    from this tree; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    site = Path(purelib)
    here = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    for dist in closure(requirements).values():
        for file in dist.files or []:
            top = file.parts[0]
            source = Path(dist.locate_file(top)).resolve()
            if top in ("..", "__pycache__") or source.parent not in here:
                continue  # scripts in bin/, and files outside site-packages
            link = site / top
            if not link.exists():
                link.symlink_to(source)
    (site / "qworker").symlink_to(REPO / "qworker")
    (site / "qworker_kernels").symlink_to(REPO / "kernels")
    return python


def qworker(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "qworker", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "HOME": str(python.parent.parent)},
    )


@pytest.fixture(scope="module")
def installs(tmp_path_factory) -> dict[str, Path]:
    base = PROJECT["dependencies"]
    extras = PROJECT["optional-dependencies"]
    root = tmp_path_factory.mktemp("installs")
    return {
        "base": make_venv(root / "base", base),
        "gateway": make_venv(root / "gateway", [*base, *extras["gateway"]]),
        "engine": make_venv(root / "engine", [*base, *extras["engine"]]),
    }


HELP_COMMANDS = ([], ["gateway"], ["submit"], ["worker"], ["bench"], ["batch"], ["dlq"], ["demo"])
# Every command's --help in one process (the imports are the point; CliRunner runs the real app).
HELP_DRIVER = f"""
import json
from typer.testing import CliRunner
from qworker.cli import app
runner = CliRunner()
codes = {{}}
for command in {HELP_COMMANDS!r}:
    result = runner.invoke(app, [*command, "--help"])
    name = " ".join(command) or "qworker"
    codes[name] = (result.exit_code, "Usage:" in result.output, repr(result.exception))
print(json.dumps(codes))
"""


@pytest.mark.parametrize("install", ["base", "gateway"])
def test_every_command_help_starts_on_the_install(installs, install):
    done = subprocess.run(
        [str(installs[install]), "-c", HELP_DRIVER], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(code == 0 and has_usage for code, has_usage, _ in codes.values()), codes
    assert qworker(installs[install], "--help").returncode == 0  # and through `python -m qworker`


def test_the_base_install_has_no_engine_or_gateway_libraries(installs):
    names = ("numpy", "torch", "fastapi", "boto3", "kombu")
    code = f"import importlib.util as u; print([m for m in {names!r} if u.find_spec(m)])"
    done = subprocess.run([str(installs["base"]), "-c", code], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_gateway_on_an_engine_install_names_the_extra_in_one_line(installs):
    done = qworker(installs["engine"], "gateway", "--queue", "redis://127.0.0.1:1/0")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (
        "qworker: error: the gateway needs fastapi, uvicorn, httpx: pip install 'qworker[gateway]'"
    ), done.stderr[-3000:]


def test_a_producer_without_boto3_is_told_which_extra(installs):
    done = qworker(installs["base"], "submit", "--queue", "sqs://jobs", "hello")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "pip install 'qworker[aws]'" in done.stderr and "Traceback" not in done.stderr
