"""The one reading of a client library's failure, for the worker's retry (worker/retry.py) and the
commands' exit codes (cli_errors.py) alike.

Each backend package in BACKENDS has an `errors.py` with `LIBRARIES` (the client libraries whose
exceptions it reads) and `translate_error(exc) -> BrokerError | None` (None: not one of its
library's failures). `translate_error` here asks them in table order, and only those whose library
this process has imported: an exception of a library nobody imported cannot exist, and a light
command must not import boto3 or kombu to read a redis error. The builtin ConnectionError and
TimeoutError (a socket reset, a read that timed out) are transient whichever backend raised them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from qworker.backends import BACKENDS
from qworker.errors import BrokerError, TransientBrokerError

ErrorTranslator = Callable[[BaseException], "BrokerError | None"]


@dataclass(frozen=True)
class BackendErrors:
    """One backend's errors module: the libraries it reads and its translation."""

    package: str
    libraries: tuple[str, ...]
    translate: ErrorTranslator


@cache
def backend_errors(package: str) -> BackendErrors:
    module = importlib.import_module(f"{package}.errors")
    return BackendErrors(package, tuple(module.LIBRARIES), module.translate_error)


def backend_packages() -> tuple[str, ...]:
    """The backend packages, in table order, each once (several schemes share one)."""
    return tuple(dict.fromkeys(BACKENDS.values()))


def translate_error(exc: BaseException) -> BrokerError | None:
    """qworker's reading of `exc` (a BrokerError with `exc` as its cause), or None when `exc` is no
    store's failure (a bug, a bad argument): those propagate as they are."""
    if isinstance(exc, BrokerError):
        return exc
    for package in backend_packages():
        errors = backend_errors(package)
        if not any(library in sys.modules for library in errors.libraries):
            continue
        translated = errors.translate(exc)
        if translated is not None:
            translated.__cause__ = exc
            return translated
    if isinstance(exc, ConnectionError | TimeoutError):
        translated = TransientBrokerError(str(exc) or type(exc).__name__)
        translated.__cause__ = exc
        return translated
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` says a store is away for now (retry) rather than that the call is wrong."""
    return isinstance(translate_error(exc), TransientBrokerError)
