"""The in-memory backend uses no client library, so it has no library errors to read (LIBRARIES
is empty and ../errors.py never asks it); its queue raises nothing but qworker's own errors."""

from __future__ import annotations

from qworker.errors import BrokerError

LIBRARIES: tuple[str, ...] = ()


def translate_error(exc: BaseException) -> BrokerError | None:
    return None
