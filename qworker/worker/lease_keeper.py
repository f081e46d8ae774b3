"""Lease extension while an engine step runs.

The loop extends its leases between steps, on a timer. One step can outlast a lease: a long
prefill chunk on a slow CPU (bf16 without native bf16 instructions runs a 2,048-token chunk of
even a small model for many seconds). Without extension the broker would hand the job to a peer,
or back to this worker as a further delivery that counts towards its dead-letter limit, while the
step is still computing it. A thread of this class extends them during such a step.

The source is never used from two threads at once: the keeper calls `source.extend` only while a
step runs (when the loop does not use the source) and under the lock that `step_ended` takes, so
the loop waits for an extension in flight before it touches the source again. A step shorter than
the extension interval costs two uncontended lock round trips and nothing else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from qworker.backends.source import JobSource, Lease

logger = logging.getLogger(__name__)


class StepLeaseKeeper:
    """Extends `leases()` every `interval_s` while a step runs longer than that."""

    def __init__(self, source: JobSource, leases: Callable[[], list[Lease]], interval_s: float) -> None:
        self._source = source
        self._leases = leases
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # time.monotonic() of the latest extension, by the loop or the keeper.
        self._extended_at = time.monotonic()
        self._in_step = False
        self._lost: list[Lease] = []
        self._thread: threading.Thread | None = None
        self.num_extensions = 0

    def start(self) -> None:
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="qworker-lease-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def mark_extended(self) -> None:
        """The loop extended every lease itself just now."""
        self._extended_at = time.monotonic()

    def step_started(self) -> None:
        with self._lock:
            self._in_step = True

    def step_ended(self) -> list[Lease]:
        """Ends the step (after an extension in flight) and hands back the leases found lost."""
        with self._lock:
            self._in_step = False
            lost, self._lost = self._lost, []
        return lost

    def _run(self) -> None:
        # Polling at half the interval: a lease is extended at most 1.5 intervals after the last
        # extension (half a lease at the default interval of a third of it).
        while not self._stopped.wait(max(0.05, self._interval_s / 2)):
            if time.monotonic() - self._extended_at < self._interval_s:
                continue
            with self._lock:
                if not self._in_step:
                    continue
                started = time.monotonic()
                try:
                    leases = self._leases()
                    if not leases:
                        continue
                    lost = self._source.extend(leases)
                except Exception as exc:
                    # The loop meets the broker's state after the step, through its own calls.
                    logger.debug("extending leases during a step failed: %s", exc)
                    continue
                self._extended_at = started
                self._lost.extend(lost)
                self.num_extensions += 1
                logger.debug("extended %d leases during a long step (%d lost)", len(leases), len(lost))
