"""The client side of a run: sends each request at its arrival time, under a concurrency cap.

Every system's driver polls one of these with its clock. Without a cap the load is open-loop: a
request's send time is its scheduled arrival, even if the driver polls late because it was busy
running a step (the request waited in the server's queue meanwhile, and that wait is part of
its TTFT). With a cap (fixed concurrency, vLLM's --max-concurrency) a request is sent when a
slot frees: at the finish time of the request that held the slot.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from qworker.bench.workload import BenchRequest


@dataclass(frozen=True)
class SentRequest:
    request: BenchRequest
    send_time: float


class LoadGenerator:
    def __init__(self, requests: Sequence[BenchRequest], max_concurrency: int | None = None) -> None:
        assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(requests)), (
            "requests must be in arrival order"
        )
        assert max_concurrency is None or max_concurrency >= 1, f"bad max_concurrency {max_concurrency}"
        self._pending: deque[BenchRequest] = deque(requests)
        self.max_concurrency = max_concurrency
        # Times at which a concurrency slot is (or became) free; a min-heap.
        self._free_slots: list[float] = [0.0] * max_concurrency if max_concurrency is not None else []
        self.num_outstanding = 0

    @property
    def num_pending(self) -> int:
        """Requests not sent yet."""
        return len(self._pending)

    @property
    def is_exhausted(self) -> bool:
        return not self._pending

    def _slot_time(self) -> float | None:
        """When the next send may happen as far as the cap is concerned (None: no slot free)."""
        if self.max_concurrency is None:
            return 0.0
        return self._free_slots[0] if self._free_slots else None

    def next_send_time(self) -> float | None:
        """The earliest time the next request goes out; None when none can until one finishes."""
        if not self._pending:
            return None
        slot = self._slot_time()
        if slot is None:
            return None
        return max(self._pending[0].arrival_s, slot)

    def poll(self, now: float) -> list[SentRequest]:
        """Send every request due by `now`, in arrival order."""
        sent: list[SentRequest] = []
        while self._pending and self._pending[0].arrival_s <= now:
            slot = self._slot_time()
            if slot is None:
                break
            if self.max_concurrency is not None:
                heapq.heappop(self._free_slots)
            request = self._pending.popleft()
            sent.append(SentRequest(request, max(request.arrival_s, slot)))
            self.num_outstanding += 1
        return sent

    def on_finished(self, t: float) -> None:
        """A sent request finished (any status) at time t, freeing its slot."""
        assert self.num_outstanding > 0, "on_finished without an outstanding request"
        self.num_outstanding -= 1
        if self.max_concurrency is not None:
            heapq.heappush(self._free_slots, t)

    def drain(self) -> list[BenchRequest]:
        """Take every unsent request (the run is over; they will be counted as timeouts)."""
        rest = list(self._pending)
        self._pending.clear()
        return rest
