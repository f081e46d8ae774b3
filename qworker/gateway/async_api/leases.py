"""Leases: exactly one gateway replica drives a batch (or delivers a webhook) at a time, as
workers lease jobs. A lease is `SET key token NX PX ttl`; the holder extends it while it works
and releases it when done, both only while the key still holds its own token (one Lua call
each). A replica that is killed stops extending: its lease expires after `ttl`, and another
replica (or its own restart) takes the work on from the state in the store.

The holder extends from a heartbeat thread of its own (`held`), every third of the ttl, so a
slow step of the work (a sweep of thousands of pending results, the check of a large file) never
lets the lease lapse while the process lives.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from qworker.gateway.async_api.records import Records

# KEYS[1] = lease key, ARGV[1] = token, ARGV[2] = ttl ms
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class Leases:
    def __init__(self, records: Records, ttl_s: float) -> None:
        assert ttl_s > 0, f"a lease needs a positive ttl, got {ttl_s}"
        self.redis: Any = records.redis
        self.records = records
        self.ttl_ms = int(ttl_s * 1000)
        # One token per replica (per process): a restarted replica is a new holder.
        self.token = uuid.uuid4().hex
        self._extend = self.redis.register_script(_EXTEND)
        self._release = self.redis.register_script(_RELEASE)

    def _key(self, kind: str, object_id: str) -> str:
        return self.records.key("lease", kind, object_id)

    def take(self, kind: str, object_id: str) -> bool:
        """True when this replica now holds the lease (it was free, or already ours)."""
        key = self._key(kind, object_id)
        if self.redis.set(key, self.token, nx=True, px=self.ttl_ms):
            return True
        return self.extend(kind, object_id)

    def extend(self, kind: str, object_id: str) -> bool:
        """False when the lease is no longer ours (it expired and another replica took it)."""
        return bool(self._extend(keys=[self._key(kind, object_id)], args=[self.token, self.ttl_ms]))

    def release(self, kind: str, object_id: str) -> None:
        self._release(keys=[self._key(kind, object_id)], args=[self.token])

    @contextmanager
    def held(self, kind: str, object_id: str) -> Iterator[threading.Event]:
        """While the block runs, a thread extends the lease (taken already). The event is set
        once the lease is lost (another replica holds it): the block should stop at once. The
        lease is released at the end."""
        lost = threading.Event()
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.ttl_ms / 3000):
                try:
                    if not self.extend(kind, object_id):
                        lost.set()
                        return
                except Exception:  # the store is away: the lease may lapse; the work notices
                    continue

        thread = threading.Thread(target=beat, name=f"lease-{object_id[-8:]}", daemon=True)
        thread.start()
        try:
            yield lost
        finally:
            done.set()
            thread.join(timeout=5)
            if not lost.is_set():
                self.release(kind, object_id)
