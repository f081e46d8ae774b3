"""Reading many jobs' delta streams and results from asyncio, with a few connections
(redis.asyncio), for the gateway: thousands of live streams, no thread per stream.

What a reader of one job sees is what `RedisResultSink.read_deltas` yields (results.py): the
stream's backlog from its latest attempt marker on (one XRANGE), then each new entry until the
done marker, a result found while nothing arrives for a second (a trimmed or expired stream), or
TimeoutError after `timeout_s` without output.

The new entries come from a few shared readers instead of one blocking XREAD per job. Each reader
holds one connection and blocks in one XREAD over up to `KEYS_PER_READER` jobs' streams (at most
`MAX_READERS` readers; past that, they take more keys each), and hands each job's entries to its
subscriber's queue. A job that joins a reader blocked on a key set without it wakes it with
CLIENT UNBLOCK, so that its first delta is not held up to the block time. The connection pool is
bounded (`MAX_CONNECTIONS`): the readers' connections plus short commands (the backlog XRANGE, a
result GET, a cancel flag), which wait for a free connection rather than open more.

One server only (redis://, rediss://, unix://): on a cluster one XREAD cannot span slots, and a
Sentinel client needs its own pool; those stores are read the blocking way (gateway/pool.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

# At import, not at the first request: an import inside the event loop can wait seconds on the
# import lock while a worker thread imports the tokenizer's libraries, and every connection's
# header timeout runs meanwhile (a load run lost all 2,000 streams so).
import redis.asyncio as aioredis

from qworker.backends.redis import keys
from qworker.backends.redis.connection import SOCKET_CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S
from qworker.backends.redis.results import READ_POLL_S, RedisResultSink, parse_delta
from qworker.backends.sink import Delta, latest_attempt
from qworker.jobs.job import JobResult

KEYS_PER_READER = 128
MAX_READERS = 16
# Readers' connections plus short commands; more callers wait for a free one.
MAX_CONNECTIONS = MAX_READERS + 48
READ_COUNT = 256
# A reader's XREAD blocks this long at most, then reissues (picking up keys that joined).
BLOCK_MS = int(READ_POLL_S * 1000)
# A reader that should wake but whose XREAD had not reached the server yet: ask again after these.
UNBLOCK_RETRIES_S = (0.002, 0.01, 0.05)
# After a reply with entries, a reader waits this long before its next XREAD, so that one call
# takes a whole engine step's deltas: a blocked XREAD returns at the first key written (a worker's
# pipeline writes one key per job), and each call costs time in its number of keys, so reissuing
# at once would cost one call per delta. The price: up to this much added to a delta's latency.
COALESCE_S = 0.005

Entries = list[tuple[bytes, dict[bytes, bytes]]]


@dataclass(eq=False)
class _Subscription:
    key: bytes
    last_id: bytes | str
    entries: asyncio.Queue[Entries] = field(default_factory=asyncio.Queue)


class _Reader:
    """One connection, one XREAD over its subscriptions' streams at a time."""

    def __init__(self, hub: DeltaHub) -> None:
        self.hub = hub
        self.subscriptions: dict[bytes, _Subscription] = {}
        # XREADs issued so far, and the one in flight (None: none is).
        self.generation = 0
        self.blocked_generation: int | None = None
        self.is_waking = False
        self.client_id: int | None = None
        self.has_subscriptions = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def add(self, subscription: _Subscription) -> None:
        self.subscriptions[subscription.key] = subscription
        self.has_subscriptions.set()
        # Only an XREAD in flight lacks the key; any later one includes it.
        if self.blocked_generation is not None and not self.is_waking:
            self.is_waking = True
            asyncio.get_running_loop().create_task(self._wake(self.blocked_generation))

    def remove(self, subscription: _Subscription) -> None:
        if self.subscriptions.get(subscription.key) is subscription:
            del self.subscriptions[subscription.key]

    async def _wake(self, generation: int) -> None:
        """Unblock the XREAD in flight, which lacks the key just added. The command may not have
        reached the server yet (CLIENT UNBLOCK then finds nothing blocked): a few tries, then
        the block time bounds the wait."""
        try:
            for delay_s in UNBLOCK_RETRIES_S:
                if self.blocked_generation != generation or self.client_id is None:
                    return
                if await self.hub.redis.client_unblock(self.client_id):
                    return
                await asyncio.sleep(delay_s)
        finally:
            self.is_waking = False

    async def _run(self) -> None:
        client = aioredis.Redis(connection_pool=self.hub.pool, single_connection_client=True)
        try:
            self.client_id = int(await client.client_id())
            while not self.hub.is_closed:
                if not self.subscriptions:
                    self.has_subscriptions.clear()
                    await self.has_subscriptions.wait()
                    continue
                streams = {key: sub.last_id for key, sub in self.subscriptions.items()}
                self.generation += 1
                self.blocked_generation = self.generation
                try:
                    reply = await client.xread(streams, count=READ_COUNT, block=BLOCK_MS)
                except Exception as exc:  # the store went away: every subscriber hears it
                    self.blocked_generation = None
                    for sub in list(self.subscriptions.values()):
                        sub.entries.put_nowait([(b"", {b"error": repr(exc).encode()})])
                    await asyncio.sleep(BLOCK_MS / 1000)
                    continue
                self.blocked_generation = None
                for key, entries in reply or []:
                    sub = self.subscriptions.get(key)
                    if sub is not None and entries:
                        sub.last_id = entries[-1][0]
                        sub.entries.put_nowait(entries)
                if reply:
                    await asyncio.sleep(COALESCE_S)
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()


class DeltaHub:
    def __init__(self, sink: RedisResultSink, connection_url: str) -> None:
        self.sink = sink  # for its key layout only: no call on it blocks here
        self.pool = aioredis.BlockingConnectionPool.from_url(
            connection_url,
            max_connections=MAX_CONNECTIONS,
            timeout=None,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=SOCKET_CONNECT_TIMEOUT_S,
        )
        self.redis = aioredis.Redis(connection_pool=self.pool)
        self.readers: list[_Reader] = []
        self.is_closed = False

    @property
    def num_subscriptions(self) -> int:
        return sum(len(r.subscriptions) for r in self.readers)

    def _reader_for(self, key: bytes) -> _Reader:
        """The reader with the fewest keys that does not read `key` yet; a new one while there
        are fewer than MAX_READERS and every reader holds KEYS_PER_READER."""
        free = [r for r in self.readers if key not in r.subscriptions]
        least = min(free, key=lambda r: len(r.subscriptions), default=None)
        if least is None or (len(least.subscriptions) >= KEYS_PER_READER and len(self.readers) < MAX_READERS):
            least = _Reader(self)
            self.readers.append(least)
        return least

    async def read_deltas(self, job_id: str, timeout_s: float | None) -> AsyncIterator[Delta]:
        """As RedisResultSink.read_deltas (the module's docstring), as a coroutine."""
        key = self.sink.delta_key(job_id).encode()
        backlog = await self.redis.xrange(key, "-", "+")
        last_id: bytes | str = "0-0"
        if backlog:
            last_id = backlog[-1][0]
            parsed = [parse_delta(job_id, fields) for _, fields in backlog]
            ended = next((i for i, delta in enumerate(parsed) if delta is None), None)
            for delta in latest_attempt([d for d in parsed[:ended] if d is not None]):
                yield delta
            if ended is not None:
                return
        consumed_id = last_id  # the last entry yielded ("0-0": none)
        subscription = _Subscription(key, last_id)
        reader = self._reader_for(key)
        reader.add(subscription)
        last_progress = time.monotonic()
        try:
            while True:
                wait_s = READ_POLL_S
                if timeout_s is not None:
                    wait_s = min(wait_s, max(0.001, timeout_s - (time.monotonic() - last_progress)))
                try:
                    async with asyncio.timeout(wait_s):
                        entries = await subscription.entries.get()
                except TimeoutError:
                    if await self.has_result(job_id):
                        # Every delta was written before the result: read what this reader has not
                        # yielded yet (the reader may be handing it over right now) straight.
                        start = b"(" + consumed_id if isinstance(consumed_id, bytes) else "-"
                        for _, fields in await self.redis.xrange(key, start, "+"):
                            delta = parse_delta(job_id, fields)
                            if delta is None:
                                return
                            yield delta
                        return
                    if timeout_s is not None and time.monotonic() - last_progress >= timeout_s:
                        raise TimeoutError(f"no output from job {job_id} for {timeout_s:.1f}s") from None
                    continue
                for entry_id, fields in entries:
                    if not entry_id:
                        raise ConnectionError(fields[b"error"].decode())
                    delta = parse_delta(job_id, fields)
                    if delta is None:
                        return
                    consumed_id = entry_id
                    yield delta
                last_progress = time.monotonic()
        finally:
            reader.remove(subscription)

    async def has_result(self, job_id: str) -> bool:
        return bool(await self.redis.exists(self._key(keys.result_key, job_id)))

    async def get_result(self, job_id: str) -> JobResult | None:
        raw = await self.redis.get(self._key(keys.result_key, job_id))
        return JobResult.model_validate_json(raw) if raw is not None else None

    async def request_cancel(self, job_id: str) -> None:
        await self.redis.set(self._key(keys.cancel_key, job_id), b"1", ex=keys.DEFAULT_CANCEL_TTL_S)

    def _key(self, key_of: Callable[[str, str], str], job_id: str) -> str:
        return key_of(self.sink.prefix, self.sink.layout.job(job_id))

    async def aclose(self) -> None:
        self.is_closed = True
        for reader in self.readers:
            reader.task.cancel()
        for reader in self.readers:
            with contextlib.suppress(BaseException):
                await reader.task
        await self.redis.aclose()
        await self.pool.aclose()


def open_delta_hub(sink: Any) -> DeltaHub | None:
    """A hub over a sync Redis result store on one server, or None for any other store."""
    if not isinstance(sink, RedisResultSink) or sink.connection_url is None:
        return None
    return DeltaHub(sink, sink.connection_url)
