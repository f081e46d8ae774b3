"""Riding out a broker outage: which errors are transient, how long to wait between tries, and
when to give up.

Which errors are transient is each backend's reading of its client library's errors
(qworker/backends/*/errors.py, walked by qworker/backends/errors.py); this module only asks.
The worker loop owns one `BrokerOutage`. A broker call that fails with a transient error
(`is_transient`) opens the outage (or counts one more failure in it); the next try waits an
exponentially growing, jittered delay; the first call that succeeds closes it. When an outage
has lasted `limit_s`, `failed` raises `BrokerOutageError` and the worker exits.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from qworker.backends.errors import is_transient as backends_is_transient
from qworker.errors import QworkerError

logger = logging.getLogger(__name__)

# The first retry after this long, doubling per failure up to MAX_BACKOFF_S.
BASE_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


class BrokerOutageError(QworkerError):
    """The broker stayed unreachable longer than the outage limit."""

    def __init__(self, message: str, outage_s: float) -> None:
        super().__init__(message)
        self.outage_s = outage_s


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` says the broker is away for now (retry) rather than that the call is wrong:
    whether its backend reads it as a TransientBrokerError (qworker/backends/errors.py asks each
    backend's errors.py; the CLI's exit codes read the same translation)."""
    return backends_is_transient(exc)


class BrokerOutage:
    """The outage clock and the retry schedule of one worker."""

    def __init__(
        self,
        limit_s: float,
        *,
        base_backoff_s: float = BASE_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if limit_s <= 0:
            raise ValueError(f"limit_s must be > 0, got {limit_s}")
        self.limit_s = limit_s
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._rng = rng or random.Random()
        self.started_at: float | None = None
        self.num_failures = 0
        self.next_try_at = 0.0
        self.last_error = ""
        # Outages survived so far (for logs and tests).
        self.num_outages = 0

    @property
    def is_down(self) -> bool:
        return self.started_at is not None

    @property
    def elapsed_s(self) -> float:
        return 0.0 if self.started_at is None else self._clock() - self.started_at

    def may_try(self) -> bool:
        """Whether a broker call is due: always when the broker is up, else after the backoff."""
        return self.started_at is None or self._clock() >= self.next_try_at

    def backoff_s(self, num_failures: int) -> float:
        """The wait after the `num_failures`-th failure in a row: half the exponential delay
        fixed, half random, so that workers that lost the broker together do not return together."""
        delay = min(self.max_backoff_s, self.base_backoff_s * 2 ** max(0, num_failures - 1))
        return delay / 2 + self._rng.uniform(0, delay / 2)

    def failed(self, exc: BaseException, what: str) -> None:
        """A broker call (`what`, for the log) failed with a transient error. Raises
        BrokerOutageError once the outage has lasted the limit."""
        now = self._clock()
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"
        if self.started_at is None:
            self.started_at = now
            self.num_failures = 0
            logger.warning("broker unreachable (%s); retrying for up to %.0fs", self.last_error, self.limit_s)
        self.num_failures += 1
        self.next_try_at = now + self.backoff_s(self.num_failures)
        if now - self.started_at >= self.limit_s:
            raise BrokerOutageError(
                f"the broker was unreachable for {now - self.started_at:.1f}s, past the limit of "
                f"{self.limit_s:.0f}s (--broker-outage-s); last error: {self.last_error}",
                now - self.started_at,
            )

    def succeeded(self) -> bool:
        """A broker call succeeded. True when that ends an outage (the caller re-checks leases)."""
        if self.started_at is None:
            return False
        logger.warning(
            "broker reachable again after %.1fs (%d failed tries)",
            self._clock() - self.started_at,
            self.num_failures,
        )
        self.started_at = None
        self.num_failures = 0
        self.num_outages += 1
        return True

    def check_limit(self) -> None:
        """Raise BrokerOutageError if an outage has lasted the limit (between tries, too)."""
        if self.started_at is not None and self._clock() - self.started_at >= self.limit_s:
            raise BrokerOutageError(
                f"the broker was unreachable for {self.elapsed_s:.1f}s, past the limit of "
                f"{self.limit_s:.0f}s (--broker-outage-s); last error: {self.last_error}",
                self.elapsed_s,
            )
