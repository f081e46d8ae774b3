"""The streams of one Redis Streams queue and who reads which: the priority lane, the shared
stream, and the affinity lanes with their owners (docs/queues.md, "Affinity lanes").

A queue with `affinity_lanes=L` (L > 1) has L keyed lanes beside its stream. A producer puts a
job with an affinity key on lane `lane_index(key, L)`, and a job without one (and every job of a
producer that knows no lanes) on the stream itself, which every worker reads as its own. Each
lane has one owner among the live workers, by rendezvous hashing: the worker with the highest
`hash(worker, lane)` owns it, so a worker joining or leaving moves only the lanes it takes or
gives up (about 1/N of them). A worker reads, most urgent first: the priority lane, then its own
lanes and the stream (the oldest entries first across them), then, with room left, the other
lanes' entries that have waited `steal_after_s`, the oldest first (work stealing: no job waits
long behind a busy or dead owner). With L = 1 there are no lanes and no owners: the stream and
its priority lane, as before.

Pure: names, message ids and ownership. The reads are in streams.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from qworker.backends.redis import keys

# The largest lane count a URL may ask for: a read over this many keys still takes about a
# millisecond of the server's time (docs/BENCHMARKS.md, "Affinity lanes").
MAX_AFFINITY_LANES = 1024


def _digest(text: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


def lane_index(affinity: str, num_lanes: int) -> int:
    """The lane of an affinity key: the first 8 bytes of its BLAKE2b digest (big-endian) modulo
    the lane count, so that a producer in any language can follow it."""
    return _digest(affinity) % num_lanes


def lane_owner(lane: int, workers: Iterable[str]) -> str | None:
    """The live worker that owns `lane`: the highest rendezvous score (ties: the greater name)."""
    return max(workers, key=lambda worker: (_digest(f"{worker}\n{lane}"), worker), default=None)


def owned_lanes(worker: str, workers: Iterable[str], num_lanes: int) -> list[int]:
    """The lanes `worker` owns among the live `workers` (itself counted as live)."""
    live = sorted({*workers, worker})
    return [lane for lane in range(num_lanes) if lane_owner(lane, live) == worker]


@dataclass(frozen=True)
class QueueStreams:
    """Every stream key of one queue, and the message ids of their entries: an entry of the
    stream keeps its id, one of the priority lane gets `high:` in front, one of lane i `lane<i>:`
    (entry ids, `<ms>-<seq>`, hold no colon)."""

    stream: str
    high: str
    lanes: tuple[str, ...]

    @classmethod
    def of(cls, stream: str, num_lanes: int, *, cluster: bool) -> QueueStreams:
        if not 1 <= num_lanes <= MAX_AFFINITY_LANES:
            raise ValueError(f"affinity_lanes must be within 1..{MAX_AFFINITY_LANES}, got {num_lanes}")
        lanes = (
            ()
            if num_lanes == 1
            else tuple(keys.lane_stream(stream, i, cluster=cluster) for i in range(num_lanes))
        )
        return cls(stream=stream, high=keys.high_lane_stream(stream), lanes=lanes)

    @property
    def num_lanes(self) -> int:
        return max(1, len(self.lanes))

    @property
    def all(self) -> tuple[str, ...]:
        """Every stream of the queue, the priority lane first."""
        return (self.high, self.stream, *self.lanes)

    def for_job(self, affinity: str | None, *, is_urgent: bool) -> str:
        """The stream a producer writes a job to."""
        if is_urgent:
            return self.high
        if not self.lanes or affinity is None:
            return self.stream
        return self.lanes[lane_index(affinity, len(self.lanes))]

    def message_id(self, stream: str, entry_id: str) -> str:
        if stream == self.stream:
            return entry_id
        if stream == self.high:
            return keys.HIGH_LANE_PREFIX + entry_id
        return f"{keys.LANE_PREFIX}{self.lanes.index(stream)}:{entry_id}"

    def locate(self, message_id: str) -> tuple[str, str]:
        """(stream, entry id) of a message id; ValueError for one of no stream of this queue."""
        if message_id.startswith(keys.HIGH_LANE_PREFIX):
            return self.high, message_id[len(keys.HIGH_LANE_PREFIX) :]
        if message_id.startswith(keys.LANE_PREFIX):
            lane, _, entry_id = message_id[len(keys.LANE_PREFIX) :].partition(":")
            if lane.isdigit() and int(lane) < len(self.lanes):
                return self.lanes[int(lane)], entry_id
            raise ValueError(f"message id {message_id!r} names a lane this queue does not have")
        return self.stream, message_id


@dataclass(frozen=True)
class ReadingOrder:
    """Which streams a worker reads, in its order: `urgent` (the priority lane), then `fair` (its
    own lanes and the shared stream), then `stealable` only for entries that have waited."""

    urgent: str
    fair: tuple[str, ...]
    stealable: tuple[str, ...]


def reading_order(streams: QueueStreams, worker: str, live: Iterable[str], rotation: int) -> ReadingOrder:
    """The reading order of `worker` given the live workers. `rotation` turns the worker's own
    lanes, so that with little room no lane is always read last."""
    if not streams.lanes:
        return ReadingOrder(streams.high, (streams.stream,), ())
    own = owned_lanes(worker, live, len(streams.lanes))
    fair = [streams.stream, *(streams.lanes[i] for i in own)]
    turn = rotation % len(fair)
    fair = fair[turn:] + fair[:turn]
    mine = set(own)
    others = tuple(lane for i, lane in enumerate(streams.lanes) if i not in mine)
    return ReadingOrder(streams.high, tuple(fair), others)
