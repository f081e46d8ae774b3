"""Queue and result backends: one package per backend, one table from URL scheme to backend.

As kombu's TRANSPORT_ALIASES does, BACKENDS maps each URL scheme to the package that serves it;
the package's `BACKEND` says which parts it provides. Every part is either an opener or a
`NotSupported` that says why not, so that an error (and the registry test) can tell the two apart:

    open_source(url, consumer, lease_timeout_s) -> JobSource        the worker's side of a queue
    open_producer(url, payload_location)        -> JobProducer      the client's side of a queue
    open_sink(url)                              -> ResultSink       results, deltas, job notes
    open_backlog(url, sizing, lease_timeout_s)  -> Backlog          queue depth in KV blocks
    open_dead_letters(url)                      -> DeadLetterQueue  list, show, replay, purge

Adding a backend is one package under qworker/backends/ and one line here. Packages are
imported when a URL first names their scheme, and they import their client library (redis,
boto3, kombu) only when they open something.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from qworker.backends.urls import InvalidURLError, redact_url, schemes_text, url_scheme
from qworker.errors import MissingDependencyError

if TYPE_CHECKING:
    from qworker.backends.backlog import Backlog
    from qworker.backends.dead_letters import DeadLetterQueue
    from qworker.backends.sink import ResultSink
    from qworker.backends.source import JobProducer, JobSource
    from qworker.pool.demand import PoolSizing

# URL scheme -> the package that serves it.
BACKENDS: dict[str, str] = {
    "redis": "qworker.backends.redis",
    "rediss": "qworker.backends.redis",
    "unix": "qworker.backends.redis",
    "redis+cluster": "qworker.backends.redis",
    "rediss+cluster": "qworker.backends.redis",
    "redis+sentinel": "qworker.backends.redis",
    "sqs": "qworker.backends.sqs",
    "s3": "qworker.backends.s3",
    "celery+redis": "qworker.backends.celery",
    "celery+rediss": "qworker.backends.celery",
    "celery+amqp": "qworker.backends.celery_amqp",
    "celery+amqps": "qworker.backends.celery_amqp",
    "memory": "qworker.backends.memory",
}


@dataclass(frozen=True)
class NotSupported:
    """A part a backend does not provide, and why (shown to whoever asks for it)."""

    reason: str


SourceOpener = Callable[[str, str, "float | None"], "JobSource"]
ProducerOpener = Callable[[str, "str | None"], "JobProducer"]
SinkOpener = Callable[[str], "ResultSink"]
BacklogOpener = Callable[[str, "PoolSizing", "float | None"], "Backlog"]
DeadLettersOpener = Callable[[str], "DeadLetterQueue"]

Part = Literal["open_source", "open_producer", "open_sink", "open_backlog", "open_dead_letters"]
# The role each part plays, in error messages.
PART_ROLES: dict[Part, str] = {
    "open_source": "queue",
    "open_producer": "queue",
    "open_sink": "results",
    "open_backlog": "backlog",
    "open_dead_letters": "dead-letter queue",
}


@dataclass(frozen=True)
class Requirement:
    """A client library a backend imports when it opens something, and the extra that installs it
    (the base install carries redis and pydantic only)."""

    module: str
    extra: str

    def is_installed(self) -> bool:
        # An imported one is installed; and find_spec raises on kombu once it is imported (kombu
        # replaces its module in sys.modules with one that has no __spec__).
        return self.module in sys.modules or importlib.util.find_spec(self.module) is not None


@dataclass(frozen=True)
class Backend:
    """What one backend package provides, and the libraries beyond the base install it needs."""

    name: str
    open_source: SourceOpener | NotSupported
    open_producer: ProducerOpener | NotSupported
    open_sink: SinkOpener | NotSupported
    open_backlog: BacklogOpener | NotSupported
    open_dead_letters: DeadLettersOpener | NotSupported
    requires: tuple[Requirement, ...] = ()

    def provides(self, part: Part) -> bool:
        return not isinstance(getattr(self, part), NotSupported)

    def missing_requirement(self) -> Requirement | None:
        """The first library this backend needs that is not installed (None: all are)."""
        return next((r for r in self.requires if not r.is_installed()), None)


def backend_parts() -> tuple[Part, ...]:
    parts = tuple(f.name for f in fields(Backend) if f.name not in ("name", "requires"))
    assert set(parts) == set(PART_ROLES), "every Backend part has a role"
    return parts  # type: ignore[return-value]


def load_backend(scheme: str) -> Backend:
    """The backend of a scheme in BACKENDS (imported on first use)."""
    backend = importlib.import_module(BACKENDS[scheme]).BACKEND
    assert isinstance(backend, Backend), f"{BACKENDS[scheme]}.BACKEND is a Backend"
    return backend


def schemes_providing(part: Part) -> tuple[str, ...]:
    """The schemes whose backend provides `part`, in table order (for help and error text)."""
    return tuple(scheme for scheme in BACKENDS if load_backend(scheme).provides(part))


def backend_for(url: str, part: Part) -> Backend:
    """The backend of `url`, checked to provide `part`; else an InvalidURLError that names the
    schemes that do (an unknown scheme and a known one without the part say different things)."""
    role = PART_ROLES[part]
    scheme = url_scheme(url)
    if not scheme:
        raise InvalidURLError(
            f"{role} URL {redact_url(url)!r} has no scheme; use {schemes_text(schemes_providing(part))}"
        )
    if scheme not in BACKENDS:
        raise InvalidURLError(
            f"unsupported {role} URL scheme {scheme!r} in {redact_url(url)!r}; "
            f"use {schemes_text(schemes_providing(part))}"
        )
    backend = load_backend(scheme)
    opener = getattr(backend, part)
    if isinstance(opener, NotSupported):
        raise InvalidURLError(
            f"a {scheme}:// URL cannot serve as the {role}: {opener.reason}; "
            f"use {schemes_text(schemes_providing(part))}"
        )
    missing = backend.missing_requirement()
    if missing is not None:
        raise MissingDependencyError(
            f"a {scheme}:// {role} needs the {missing.module} package: pip install 'qworker[{missing.extra}]'"
        )
    return backend
