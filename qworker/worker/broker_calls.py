"""Broker calls that can fail: one wrapper for the outage bookkeeping around each of them.

A call is made only when the outage's backoff allows it (retry.py). A transient error counts
toward the outage (raising BrokerOutageError past its limit) and marks the worker's health; any
other error is re-raised. The first success after an outage closes it and calls `on_recovered`
(the loop re-checks its leases then: a peer may have reclaimed a job while the broker was away,
or the broker restarted without the stream).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from qworker.health import HealthState
from qworker.worker.retry import BrokerOutage, is_transient

T = TypeVar("T")


class BrokerCalls:
    def __init__(self, outage: BrokerOutage, health: HealthState, on_recovered: Callable[[], None]) -> None:
        self.outage = outage
        self._health = health
        self._on_recovered = on_recovered

    def may_try(self) -> bool:
        return self.outage.may_try()

    def fetch(self, what: str, call: Callable[[], T]) -> T | None:
        """`call()`'s value, or None when it was not made (not due) or failed transiently.
        `what` names the call in logs; `call` must not return None itself."""
        if not self.outage.may_try():
            return None
        try:
            value = call()
        except Exception as exc:
            self.failed(exc, what)
            return None
        assert value is not None, f"{what}: a fetched broker call returns a value"
        self.succeeded()
        return value

    def make(self, what: str, call: Callable[[], object]) -> bool:
        """Make a call whose value does not matter; True if it was made."""

        def made() -> bool:
            call()
            return True

        return self.fetch(what, made) is not None

    def failed(self, exc: Exception, what: str) -> None:
        """A broker call made outside this wrapper failed: the same bookkeeping."""
        if not is_transient(exc):
            raise exc
        self.outage.failed(exc, what)
        self._health.set_broker_outage(self.outage.last_error)

    def succeeded(self) -> None:
        if self.outage.succeeded():
            self._health.set_broker_outage(None)
            self._on_recovered()
