"""What a Celery job source holds besides its leases: tasks whose eta is ahead, and revoked ids.

Both Celery transports (kombu's Redis transport and RabbitMQ) take a task with an `eta` from the
queue as soon as it is there, as Celery's own workers do, and hold it back until the eta comes;
and both remember the task ids that `revoke` broadcasts, bounded as Celery's workers bound them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from qworker.backends.source import Lease

# Revoked task ids remembered, as Celery's workers do (celery.worker.state REVOKES_MAX and
# REVOKE_EXPIRES).
REVOKED_MAX = 50_000
REVOKED_TTL_S = 10_800


class EtaHold:
    """Leases held back until their task's eta, earliest first."""

    def __init__(self) -> None:
        self._etas: dict[str, float] = {}
        self._held: list[tuple[float, Lease]] = []

    def note_eta(self, message_id: str, eta: float) -> None:
        """The eta of a message being leased; `hold` consults it."""
        self._etas[message_id] = eta

    def hold(self, lease: Lease) -> bool:
        """Hold back `lease` if its eta is ahead; True when it was."""
        eta = self._etas.pop(lease.message_id, None)
        if eta is None or eta <= time.time():
            return False
        self._held.append((eta, lease))
        self._held.sort(key=lambda item: item[0])
        return True

    def take_due(self, max_count: int) -> list[Lease]:
        """At most `max_count` held leases whose eta has come, earliest first; no longer held."""
        now = time.time()
        due = [lease for eta, lease in self._held if eta <= now][:max_count]
        self._held = [(eta, lease) for eta, lease in self._held if lease not in due]
        return due

    def keep_only(self, keep: Callable[[Lease], bool]) -> None:
        """Forget the held leases for which `keep` is false (lost to the broker)."""
        self._held = [(eta, lease) for eta, lease in self._held if keep(lease)]

    def leases(self) -> list[Lease]:
        return [lease for _, lease in self._held]

    def clear(self) -> None:
        self._held = []

    def __len__(self) -> int:
        return len(self._held)


class RevokedIds:
    """Task ids a `revoke` was heard for: at most REVOKED_MAX, each for REVOKED_TTL_S."""

    def __init__(self) -> None:
        self._heard_at: dict[str, float] = {}

    def add(self, task_ids: Iterable[str]) -> None:
        for task_id in task_ids:
            self._heard_at.pop(task_id, None)  # re-inserted last: the newest
            self._heard_at[task_id] = time.monotonic()
        cutoff = time.monotonic() - REVOKED_TTL_S
        while self._heard_at:
            oldest, heard_at = next(iter(self._heard_at.items()))
            if heard_at >= cutoff and len(self._heard_at) <= REVOKED_MAX:
                break
            del self._heard_at[oldest]

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._heard_at
