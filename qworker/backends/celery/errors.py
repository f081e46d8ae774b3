"""Celery on Redis: its messages move through redis-py (read as ../redis/errors.py reads them) and,
for the producer and the queue's declaration, kombu, whose OperationalError is kombu's wrapping
of a transport that cannot connect ("recoverable": transient)."""

from __future__ import annotations

import sys

from qworker.backends.redis.errors import translate_error as translate_redis_error
from qworker.errors import BrokerError, TransientBrokerError

LIBRARIES = ("redis", "kombu")


def translate_error(exc: BaseException) -> BrokerError | None:
    if "kombu" in sys.modules:
        from kombu.exceptions import OperationalError

        if isinstance(exc, OperationalError):
            return TransientBrokerError(str(exc) or type(exc).__name__)
    return translate_redis_error(exc)
