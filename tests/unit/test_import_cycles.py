"""No import cycles inside qworker: the graph of which module imports which has no cycle, counting
every import: at the top of a file, in module-level if/try/with blocks (`if TYPE_CHECKING:`
included: a type shared both ways is a circle too, cured the same way, by moving the shared types
down) and inside functions. A lazy import keeps a heavy dependency out of a light command; it must
still point down, or the two modules are one concern split in two.

Read from the source with `ast`: nothing is imported, so it costs well under a second.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import qworker

pytestmark = pytest.mark.timeout(60)

PACKAGE_DIR = Path(qworker.__file__).resolve().parent


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: not those in functions or
    classes."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


def _everywhere(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, those in functions and classes included."""
    for statement in body:
        for node in ast.walk(statement):
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node


def imported_modules(name: str, path: Path, known: set[str], *, include_lazy: bool = True) -> set[str]:
    """The package's modules that `name` imports (at module level only, without `include_lazy`).
    `from a.b import c` counts as an import of `a.b.c` when that is a module, else of `a.b`."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    walk = _everywhere if include_lazy else _module_level
    for node in walk(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        found.update(t for t in targets if t in known and t != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def import_graph(package_dir: Path, *, include_lazy: bool = True) -> dict[str, set[str]]:
    modules = module_files(package_dir)
    known = set(modules)
    return {
        name: imported_modules(name, path, known, include_lazy=include_lazy) for name, path in modules.items()
    }


def test_the_checker_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n"
    )
    (pkg / "c.py").write_text("import pkg.a\n\ndef lazy():\n    from pkg import d\n")
    (pkg / "d.py").write_text("from pkg.c import lazy\n")
    graph = import_graph(pkg, include_lazy=False)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    # Counting the import inside lazy(), c and d import each other too.
    graph = import_graph(pkg)
    assert graph["pkg.c"] == {"pkg.a", "pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.d", "pkg.sub.b"]]
    (pkg / "c.py").write_text("import pkg.d\n")
    assert cycles(import_graph(pkg)) == [["pkg.c", "pkg.d"]]
    (pkg / "d.py").write_text("import pkg\n")
    assert cycles(import_graph(pkg)) == []


def test_qworker_has_no_import_cycles():
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 50, f"found only {len(graph)} modules under {PACKAGE_DIR}"
    found = cycles(graph)
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
