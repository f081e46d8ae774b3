"""Backpressure on KV demand, and the bound on this replica's own work.

The rule (docs/gateway.md): a generation request is refused with 429 and Retry-After when

    waiting_blocks + this_request_blocks > max_waiting_blocks     (and something is waiting)

where waiting_blocks is the KV demand of the jobs no worker holds yet (qworker.pool.demand:
ceil((prompt_tokens + max_tokens) / block_size) per job, read from the queue by the same backlog
readers the autoscaling exporter uses), refreshed every `demand_interval_s`, plus the blocks this
replica enqueued since that reading. A request arriving while nothing waits always passes, so one
large request is never refused by a bound it alone exceeds. The bound is in blocks, not jobs: ten
4,000-token prompts weigh what they cost.

Independently, at most `max_inflight_requests` generation requests run in this replica at once
(429 beyond), so its memory stays bounded whatever the clients do.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from qworker.gateway.errors import GatewayError

logger = logging.getLogger(__name__)


class DemandGate:
    def __init__(
        self,
        *,
        reader: Any | None,  # a qworker.pool.exporter.PoolDemandReader, or None: no KV bound
        max_waiting_blocks: int | None,
        interval_s: float,
        retry_after_s: int,
        max_inflight_requests: int,
    ) -> None:
        assert (reader is None) == (max_waiting_blocks is None), "a KV bound needs a demand reader"
        self.reader = reader
        self.max_waiting_blocks = max_waiting_blocks
        self.interval_s = interval_s
        self.retry_after_s = retry_after_s
        self.max_inflight_requests = max_inflight_requests
        self.num_inflight = 0
        # The last reading (None: none succeeded yet) and what this replica added since.
        self.waiting_blocks: int | None = None
        self.num_added_blocks = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._has_reading = threading.Event()

    def start(self) -> None:
        if self.reader is None:
            return
        self._thread = threading.Thread(target=self._read_loop, name="gateway-demand", daemon=True)
        self._thread.start()

    def _read_loop(self) -> None:
        assert self.reader is not None
        while not self._stop.is_set():
            try:
                demand = self.reader.read()
            except Exception:
                logger.warning(
                    "reading the queue's KV demand failed; keeping the last reading", exc_info=True
                )
            else:
                with self._lock:
                    self.waiting_blocks = demand.waiting.num_blocks
                    self.num_added_blocks = 0
                self._has_reading.set()
            self._stop.wait(self.interval_s)

    def wait_first_reading(self, timeout_s: float) -> bool:
        return self.reader is None or self._has_reading.wait(timeout_s)

    def _refuse(self, message: str, code: str) -> GatewayError:
        return GatewayError(429, message, code=code, headers={"Retry-After": str(self.retry_after_s)})

    def admit(self, num_blocks: int) -> Admission:
        """Take one in-flight slot for the request, if the rules allow it (else 429). Release it
        when the request's response is done (a stream: when the stream ends)."""
        with self._lock:
            if self.num_inflight >= self.max_inflight_requests:
                raise self._refuse(
                    f"this gateway serves {self.max_inflight_requests} requests at once; retry later",
                    "too_many_requests",
                )
            if self.max_waiting_blocks is not None and self.waiting_blocks is not None:
                waiting = self.waiting_blocks + self.num_added_blocks
                if waiting > 0 and waiting + num_blocks > self.max_waiting_blocks:
                    raise self._refuse(
                        f"the pool is saturated: {waiting} KV blocks of work wait in the queue and this "
                        f"request needs {num_blocks} more (bound {self.max_waiting_blocks}); retry later",
                        "queue_saturated",
                    )
            self.num_inflight += 1
            self.num_added_blocks += num_blocks
        return Admission(self)

    def _release(self) -> None:
        with self._lock:
            self.num_inflight -= 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.reader is not None:
            self.reader.close()


class Admission:
    """One admitted request's in-flight slot; release() is idempotent."""

    def __init__(self, gate: DemandGate) -> None:
        self._gate: DemandGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            self._gate._release()
            self._gate = None
