"""Every QWORKER_* environment variable is listed in qworker/envs.py with its meaning and documented
in docs/configuration.md; code reads them through that list, never os.environ directly; and an
explicit option wins over a variable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from qworker import envs
from qworker.model.attention import select_attention_backend

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bQWORKER_[A-Z0-9_]+\b")
# Where variables are set or read: the packages, scripts, tests, container and cluster files.
SCANNED = ("qworker", "kernels", "scripts", "tests", "infra")
SCANNED_SUFFIXES = {".py", ".c", ".sh", ".yaml", ".yml", ".toml", ""}
# Include guards of the C headers (kernels/cpu_simd.h, cpu_amx.h) are not variables.
HEADER_GUARD = re.compile(r"^QWORKER_\w+_H$")
ENVS_MODULES = {REPO / "qworker" / "envs.py", REPO / "kernels" / "envs.py"}
# Direct reads left in files owned by another change of this round, each with the reason.
DIRECT_READ_EXCEPTIONS: dict[str, str] = {}


def source_files() -> list[Path]:
    files = [REPO / "Makefile"]
    for top in SCANNED:
        for path in (REPO / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in SCANNED_SUFFIXES:
                files.append(path)
    return [f for f in files if f.name != "test_envs.py"]


def names_in_sources() -> dict[str, str]:
    """Each QWORKER_ name in the sources -> the first file that holds it."""
    found: dict[str, str] = {}
    for path in source_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for name in NAME.findall(text):
            if not HEADER_GUARD.match(name):
                found.setdefault(name, str(path.relative_to(REPO)))
    return found


def test_every_variable_in_the_sources_is_listed():
    found = names_in_sources()
    assert "QWORKER_KV_WRITE" in found and "QWORKER_QUEUE_URL" in found, "the scan found nothing"
    unlisted = {name: where for name, where in found.items() if name not in envs.ENV_VARS}
    assert not unlisted, f"QWORKER_ variables not in qworker/envs.py ENV_VARS: {unlisted}"


def test_every_listed_variable_is_used_and_has_a_meaning():
    found = names_in_sources()
    for name, var in envs.ENV_VARS.items():
        assert var.name == name
        assert name in found, f"{name} is listed but nothing uses it"
        assert len(var.meaning) > 20, f"{name}: say what it does"


def _documented() -> dict[str, str]:
    """docs/configuration.md's variables table: name -> meaning."""
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text.split("## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if line.startswith("| `QWORKER_"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[-1]
    return rows


def test_docs_list_exactly_the_variables():
    documented = _documented()
    assert set(documented) == set(envs.ENV_VARS), (
        f"docs/configuration.md lacks {sorted(set(envs.ENV_VARS) - set(documented))}, "
        f"lists unknown {sorted(set(documented) - set(envs.ENV_VARS))}"
    )
    assert all(documented.values()), "a variable without a meaning in the docs"
    readme = (REPO / "README.md").read_text()
    assert "docs/configuration.md" in readme.split("## Configuration\n", 1)[1].split("\n## ", 1)[0]


def _qworker_literals(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a QWORKER_ string: NAME_ENV = "QWORKER_X"."""
    bound: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            value = node.value.value
            if isinstance(value, str) and value.startswith("QWORKER_"):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        bound[target.id] = value
    return bound


def _is_environ(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def direct_reads(path: Path, where: str | None = None) -> list[str]:
    """`os.environ.get(K)`, `os.getenv(K)`, `os.environ[K]`, `K in os.environ` with K a QWORKER_
    literal or a module name bound to one."""
    tree = ast.parse(path.read_text())
    bound = _qworker_literals(tree)
    where = where or str(path.relative_to(REPO))

    def variable(key: ast.expr) -> str | None:
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("QWORKER_"):
            return key.value
        if isinstance(key, ast.Name):
            return bound.get(key.id)
        return None

    reads = []
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and (
                (func.attr == "get" and _is_environ(func.value)) or func.attr == "getenv"
            ):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        name = variable(key) if key is not None else None
        if name is not None:
            reads.append(f"{where}:{node.lineno} reads {name}")
    return reads


def test_the_packages_read_variables_only_through_envs():
    reads = []
    for top in ("qworker", "kernels"):
        for path in (REPO / top).rglob("*.py"):
            relative = str(path.relative_to(REPO))
            if path in ENVS_MODULES or relative in DIRECT_READ_EXCEPTIONS:
                continue
            reads += direct_reads(path)
    assert not reads, "read these through qworker/envs.py (or qworker_kernels/envs.py):\n" + "\n".join(reads)


def test_the_direct_read_check_finds_the_old_forms(tmp_path):
    # The check above can fail: each form it looks for is found.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nX_ENV = 'QWORKER_X'\n"
        "a = os.environ.get('QWORKER_A')\nb = os.getenv(X_ENV)\n"
        "c = os.environ['QWORKER_C']\nd = 'QWORKER_D' in os.environ\n"
    )
    reads = direct_reads(sample, "sample.py")
    assert [r.rsplit(" ", 1)[1] for r in reads] == ["QWORKER_A", "QWORKER_X", "QWORKER_C", "QWORKER_D"]


def test_the_kernels_package_imports_no_qworker():
    for path in (REPO / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            assert not any(m == "qworker" or m.startswith("qworker.") for m in modules), (
                f"{path.name} imports {modules}: qworker_kernels must not import qworker"
            )


# -- precedence and parsing ---------------------------------------------------------------------


@pytest.mark.parametrize("variable", ["triton", "torch"])
def test_an_explicit_attention_backend_wins_over_the_variable(monkeypatch, variable):
    monkeypatch.setenv("QWORKER_ATTENTION_BACKEND", variable)
    assert select_attention_backend("torch", torch.device("cpu")).name == "torch"


def test_the_attention_variable_decides_auto(monkeypatch):
    monkeypatch.setenv("QWORKER_ATTENTION_BACKEND", "torch")
    assert select_attention_backend("auto", torch.device("cpu")).name == "torch"
    monkeypatch.setenv("QWORKER_ATTENTION_BACKEND", "flash")
    with pytest.raises(envs.EnvVarError, match=r"\$QWORKER_ATTENTION_BACKEND='flash'"):
        select_attention_backend("auto", torch.device("cpu"))


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("yes", True), ("ON", True), ("0", False), ("off", False), ("", False)]
)
def test_flags_read_words_and_zero_means_off(monkeypatch, raw, value):
    # Before, any non-empty value (QWORKER_DISABLE_CPU_KERNEL=0 too) switched the kernels off.
    monkeypatch.setenv("QWORKER_DISABLE_CPU_KERNEL", raw)
    assert envs.QWORKER_DISABLE_CPU_KERNEL.get() is value


def test_a_bad_flag_is_an_error_that_names_the_variable(monkeypatch):
    monkeypatch.setenv("QWORKER_INVARIANT_GEMM_AMX", "maybe")
    with pytest.raises(envs.EnvVarError, match="QWORKER_INVARIANT_GEMM_AMX"):
        envs.QWORKER_INVARIANT_GEMM_AMX.get()
    monkeypatch.delenv("QWORKER_INVARIANT_GEMM_AMX")
    assert envs.QWORKER_INVARIANT_GEMM_AMX.get() is True  # the default


def test_the_cache_dir_is_one_rule_everywhere(monkeypatch, tmp_path):
    from qworker_kernels.cpu_build import cache_root as kernels_root

    from qworker.gateway.tokenizer import cache_root as gateway_cache_root
    from qworker.model.loader import cache_root
    from qworker.openai.batches.files import cache_dir

    monkeypatch.setenv("QWORKER_CACHE_DIR", str(tmp_path))
    assert cache_root() == gateway_cache_root() == cache_dir() == tmp_path
    assert kernels_root() == tmp_path / "kernels"
    monkeypatch.delenv("QWORKER_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "qworker"
