"""The workload specs that ship with qworker (`qworker bench --workload NAME`), as JSON files in this
folder. Reading their names needs no numpy, so that `qworker bench --help` lists them anywhere."""

from __future__ import annotations

from importlib import resources


def packaged_workloads() -> list[str]:
    """The names of the workload specs that ship with qworker (`offline-mixed`, ...)."""
    names = (entry.name for entry in resources.files(__name__).iterdir())
    return sorted(name.removesuffix(".json") for name in names if name.endswith(".json"))
