"""The backend table (qworker.backends.BACKENDS): every scheme names a package whose
BACKEND provides each part (a source or a result store, a producer, a backlog reader, dead-letter
tools) or declares, with a reason, that it does not; and asking for a declared-missing part is an
InvalidURLError that gives the reason and names the schemes that do provide it.

Nothing here connects anywhere: the parts are checked by their signatures, and the refusals
happen before any client library is asked for a connection.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from qworker.backends import (
    BACKENDS,
    PART_ROLES,
    Backend,
    NotSupported,
    backend_for,
    backend_parts,
    connections,
    load_backend,
    schemes_providing,
)
from qworker.backends.urls import InvalidURLError
from qworker.cli_errors import EXIT_USAGE
from qworker.pool.demand import PoolSizing

pytestmark = pytest.mark.timeout(60)

# Each part's opener takes these positional parameters (backends/__init__.py's Opener types).
PART_ARITY = {
    "open_source": 3,  # url, consumer, lease_timeout_s
    "open_producer": 2,  # url, payload_location
    "open_sink": 1,  # url
    "open_backlog": 3,  # url, sizing, lease_timeout_s
    "open_dead_letters": 1,  # url
}


def test_every_part_is_checked():
    assert set(backend_parts()) == set(PART_ARITY) == set(PART_ROLES)


@pytest.mark.parametrize("scheme", list(BACKENDS))
def test_every_backend_provides_or_declares_each_part(scheme):
    backend = load_backend(scheme)
    assert isinstance(backend, Backend)
    for part in backend_parts():
        opener = getattr(backend, part)
        if isinstance(opener, NotSupported):
            assert len(opener.reason) > 20, f"{scheme}: {part} says why not"
            assert not backend.provides(part)
            continue
        assert callable(opener), f"{scheme}: {part} is an opener or NotSupported, not {opener!r}"
        assert backend.provides(part)
        parameters = inspect.signature(opener).parameters.values()
        positional = [p for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert len(positional) == PART_ARITY[part], f"{scheme}: {part}{inspect.signature(opener)}"
    # A backend is a queue or a result store, or both; a queue has both of its sides.
    assert backend.provides("open_source") or backend.provides("open_sink"), scheme
    assert backend.provides("open_source") == backend.provides("open_producer"), scheme


def test_the_parts_each_backend_provides():
    """What the table says today, spelled out: a change to it is a change to this list."""
    provided = {
        load_backend(scheme).name: tuple(p for p in backend_parts() if load_backend(scheme).provides(p))
        for scheme in BACKENDS
    }
    everything = tuple(PART_ARITY)
    assert provided == {
        "redis": everything,
        "celery": everything,
        "sqs": ("open_source", "open_producer", "open_backlog", "open_dead_letters"),
        "celery+amqp": ("open_source", "open_producer", "open_backlog", "open_dead_letters"),
        "s3": ("open_sink",),
        "memory": ("open_source", "open_producer", "open_sink"),
    }
    # One package per backend: the schemes of one backend name one package.
    assert len({BACKENDS[s] for s in BACKENDS if load_backend(s).name == "redis"}) == 1
    assert schemes_providing("open_dead_letters") == (
        "redis",
        "rediss",
        "unix",
        "redis+cluster",
        "rediss+cluster",
        "redis+sentinel",
        "sqs",
        "celery+redis",
        "celery+rediss",
        "celery+amqp",
        "celery+amqps",
    )


@pytest.mark.parametrize(
    ("opener", "url", "words"),
    [
        (lambda url: connections.open_sink(url), "sqs://jobs", "SQS is a queue"),
        (lambda url: connections.open_source(url, "c"), "s3://bucket/p", "S3 stores results"),
        (lambda url: connections.open_producer(url), "s3://bucket/p", "S3 stores results"),
        (lambda url: connections.open_backlog(url, PoolSizing()), "memory://q", "one process"),
        (lambda url: connections.open_dead_letters(url), "memory://q", "qworker dlq"),
        (lambda url: connections.open_dead_letters(url), "s3://bucket/p", "S3 stores results"),
        (lambda url: connections.open_sink(url), "celery+amqp://h/?queue=q", "RabbitMQ stores no results"),
    ],
)
def test_a_missing_part_says_why_and_what_would_serve(opener, url, words):
    with pytest.raises(InvalidURLError) as info:
        opener(url)
    message = str(info.value)
    assert words in message
    assert f"a {url.split('://')[0]}:// URL cannot serve as the" in message
    assert "redis://" in message  # the schemes that do provide the part


def test_an_unknown_scheme_is_named_as_unknown_for_every_part():
    for part, role in PART_ROLES.items():
        with pytest.raises(InvalidURLError, match=f"unsupported {role} URL scheme 'foo'"):
            backend_for("foo://bar", part)


def test_adding_a_backend_is_one_line(monkeypatch):
    monkeypatch.setitem(BACKENDS, "inproc", "qworker.backends.memory")
    assert "inproc" in connections.queue_schemes() and "inproc" in connections.result_schemes()
    source = connections.open_source("inproc://registry-test", consumer="c")
    assert source.queue_name == "memory:registry-test"
    with pytest.raises(InvalidURLError, match="inproc://"):
        connections.open_source("amqp://host", consumer="c")


def test_submit_names_an_unknown_queue_scheme_as_worker_does():
    """Issue 29: `qworker submit --queue foo://bar hi` said "a foo:// queue needs a results URL"."""
    done = subprocess.run(
        [sys.executable, "-m", "qworker", "submit", "--queue", "foo://bar", "hi"],
        capture_output=True,
        text=True,
        timeout=50,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stderr
    assert "unsupported queue URL scheme 'foo'" in done.stderr, done.stderr
    assert "needs a results URL" not in done.stderr
