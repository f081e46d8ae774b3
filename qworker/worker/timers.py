"""Named intervals for the loop's housekeeping (lease extension, cancel checks, stats)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Timers:
    def __init__(self, intervals_s: dict[str, float], clock: Callable[[], float] = time.monotonic) -> None:
        self._intervals_s = dict(intervals_s)
        self._clock = clock
        # Each is due at once: the first check of each kind happens at the first chance.
        self._last: dict[str, float | None] = dict.fromkeys(intervals_s)

    def due(self, name: str) -> bool:
        """True at most once per interval; the interval restarts when it is."""
        now = self._clock()
        last = self._last[name]
        if last is not None and now - last < self._intervals_s[name]:
            return False
        self._last[name] = now
        return True

    def make_due(self, name: str) -> None:
        """The next due(name) is True, whenever the last was."""
        self._last[name] = None
