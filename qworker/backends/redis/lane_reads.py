"""Reading a queue's streams in a worker's reading order (lanes.py): new entries, and entries
whose lease expired.

On one server (redis://, Sentinel) one script reads every stream in one round trip. On a cluster
the lanes sit in different slots and no script may span them, so the same order is read with
pipelines: one round trip to see which lanes hold entries, then one per round of reads (most
reads take one round), and for stealing two more (where each lane's next entry is, and how old).

Both readers take, in order: the priority lane (up to the count), then the fair streams' entries
(the worker's own lanes and the shared stream), the oldest first across them, then the stealable
lanes' entries that have waited `steal_after_ms`, the oldest first across them. They never take
more than the count. Oldest first keeps the pool close to one FCFS queue: a worker serves its own
lanes in arrival order, and thieves take the jobs that have waited longest wherever they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from qworker.backends.redis.lanes import ReadingOrder
from qworker.utils import as_text

# KEYS[1]: the priority lane; KEYS[2 .. 1 + num_fair]: the fair streams; the rest: stealable.
# ARGV: group, consumer, count, num_fair, steal_after_ms.
# Returns {key index (1-based), entry id, {field, value, ...}} per entry.
_READ_LUA = """
local group, consumer = ARGV[1], ARGV[2]
local left = tonumber(ARGV[3])
local num_fair = tonumber(ARGV[4])
local steal_after_ms = tonumber(ARGV[5])
local out = {}
local function take(i, count)
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count, 'STREAMS', KEYS[i], '>')
  if not reply then return 0 end
  local entries = reply[1][2]
  for _, entry in ipairs(entries) do table.insert(out, {i, entry[1], entry[2]}) end
  return #entries
end
local function stamp(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
-- The streams KEYS[first..last] hold undelivered entries: take up to `left` of them, the oldest
-- first across the streams (each stream's entries are in order, so that is its first few),
-- only those added at or before `cutoff` ms when one is given. Returns how many were taken.
local function oldest(first, last, cutoff)
  local waiting = {}
  for i = first, last do
    if redis.call('XLEN', KEYS[i]) > 0 then
      local delivered = nil
      for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[i])) do
        local info = {}
        for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
        if info['name'] == group then delivered = info['last-delivered-id'] end
      end
      if delivered then
        for _, entry in ipairs(redis.call('XRANGE', KEYS[i], '(' .. delivered, '+', 'COUNT', left)) do
          local ms, seq = stamp(entry[1])
          if cutoff and ms > cutoff then break end
          waiting[#waiting + 1] = {ms, seq, i}
        end
      end
    end
  end
  table.sort(waiting, function(a, b)
    if a[1] ~= b[1] then return a[1] < b[1] end
    if a[2] ~= b[2] then return a[2] < b[2] end
    return a[3] < b[3]
  end)
  local counts = {}
  for n = 1, math.min(left, #waiting) do
    local i = waiting[n][3]
    counts[i] = (counts[i] or 0) + 1
  end
  local got = 0
  for i = first, last do
    if counts[i] then got = got + take(i, counts[i]) end
  end
  return got
end
left = left - take(1, left)
if left > 0 and num_fair > 0 then left = left - oldest(2, num_fair + 1, nil) end
if left > 0 and #KEYS > num_fair + 1 then
  local now = redis.call('TIME')
  local cutoff = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - steal_after_ms
  left = left - oldest(num_fair + 2, #KEYS, cutoff)
end
return out
"""


@dataclass(frozen=True)
class Entry:
    stream: str
    entry_id: str
    fields: dict[Any, Any]


def _stamp(entry_id: str) -> tuple[int, int]:
    """An entry id, `<ms>-<seq>`, as numbers: its place in arrival order."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _arrival(entry: Entry) -> tuple[int, int]:
    return _stamp(entry.entry_id)


def _entries(stream: str, reply: Any) -> list[Entry]:
    """The entries of one stream in an XREADGROUP reply."""
    return [
        Entry(stream, as_text(entry_id), fields) for _, items in reply or [] for entry_id, fields in items
    ]


class ScriptLaneReader:
    """One server: the whole reading order in one script call."""

    def __init__(self, redis: Any, group: str, consumer: str) -> None:
        self.redis = redis
        self.group = group
        self.consumer = consumer
        self._read = redis.register_script(_READ_LUA)

    def read(self, order: ReadingOrder, count: int, steal_after_ms: int) -> list[Entry]:
        streams = [order.urgent, *order.fair, *order.stealable]
        reply = self._read(
            keys=streams, args=[self.group, self.consumer, count, len(order.fair), steal_after_ms]
        )
        urgent, rest = [], []
        for index, entry_id, flat in reply or []:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            entry = Entry(streams[int(index) - 1], as_text(entry_id), fields)
            (urgent if int(index) == 1 else rest).append(entry)
        return urgent + sorted(rest, key=_arrival)


class PipelinedLaneReader:
    """A cluster: the same order in pipelines, no script spanning slots."""

    def __init__(self, redis: Any, group: str, consumer: str) -> None:
        self.redis = redis
        self.group = group
        self.consumer = consumer

    def _take(self, counts: dict[str, int]) -> list[Entry]:
        pipe = self.redis.pipeline(transaction=False)
        for stream, count in counts.items():
            pipe.xreadgroup(self.group, self.consumer, {stream: ">"}, count=count)
        return [
            e for stream, reply in zip(counts, pipe.execute(), strict=True) for e in _entries(stream, reply)
        ]

    def read(self, order: ReadingOrder, count: int, steal_after_ms: int) -> list[Entry]:
        entries = _entries(
            order.urgent, self.redis.xreadgroup(self.group, self.consumer, {order.urgent: ">"}, count=count)
        )
        left = count - len(entries)
        if left <= 0:
            return entries
        others = [*order.fair, *order.stealable]
        pipe = self.redis.pipeline(transaction=False)
        for stream in others:
            pipe.xlen(stream)
        sizes = dict(zip(others, (int(n) for n in pipe.execute()), strict=True))
        fair = [s for s in order.fair if sizes[s] > 0]
        if fair:
            entries += self._oldest(fair, left, None)
            left = count - len(entries)
        stealable = [s for s in order.stealable if sizes[s] > 0]
        if left > 0 and stealable:
            entries += self._oldest(stealable, left, int(time.time() * 1000) - steal_after_ms)
        urgent = [e for e in entries if e.stream == order.urgent]
        return urgent + sorted((e for e in entries if e.stream != order.urgent), key=_arrival)

    def _oldest(self, streams: list[str], left: int, cutoff_ms: int | None) -> list[Entry]:
        """Up to `left` undelivered entries of `streams`, the oldest first across them (only those
        added at or before `cutoff_ms` when given): where each stream's next entries are, how old,
        then the reads."""
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xinfo_groups(stream)
        delivered: dict[str, str] = {}
        for stream, groups in zip(streams, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(groups, Exception):
                continue
            for group in groups:
                if as_text(group["name"]) == self.group:
                    delivered[stream] = as_text(group["last-delivered-id"])
        pipe = self.redis.pipeline(transaction=False)
        for stream, last_id in delivered.items():
            pipe.xrange(stream, f"({last_id}", "+", count=left)
        waiting: list[tuple[tuple[int, int], str]] = []
        for stream, found in zip(delivered, pipe.execute(), strict=True):
            for entry_id, _ in found:
                stamp = _stamp(as_text(entry_id))
                if cutoff_ms is not None and stamp[0] > cutoff_ms:
                    break
                waiting.append((stamp, stream))
        waiting.sort()
        counts: dict[str, int] = {}
        for _, stream in waiting[:left]:
            counts[stream] = counts.get(stream, 0) + 1
        return self._take(counts) if counts else []


# KEYS: the streams; ARGV: group, count, min_idle_ms. The expired entries of every stream, in
# order, up to the count: {key index (1-based), entry id, times delivered} each. Streams with no
# pending entries cost one XLEN-like check, so an idle worker can scan 258 streams cheaply.
_EXPIRED_LUA = """
local group, left, idle = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local out = {}
for i, key in ipairs(KEYS) do
  if left <= 0 then break end
  local ok, summary = pcall(redis.call, 'XPENDING', key, group)
  if ok and tonumber(summary[1]) > 0 then
    for _, p in ipairs(redis.call('XPENDING', key, group, 'IDLE', idle, '-', '+', left)) do
      table.insert(out, {i, p[1], p[4]})
      left = left - 1
    end
  end
end
return out
"""


class ExpiredScanner:
    """Finds entries whose lease expired: one script call on one server, a pipeline of
    XPENDING ... IDLE on a cluster."""

    def __init__(self, redis: Any, *, cluster: bool) -> None:
        self.redis = redis
        self._scan = None if cluster else redis.register_script(_EXPIRED_LUA)

    def find(
        self, streams: tuple[str, ...], group: str, count: int, min_idle_ms: int
    ) -> list[tuple[str, str, int]]:
        """(stream, entry id, times delivered) of up to `count` expired entries."""
        if self._scan is not None:
            reply = self._scan(keys=list(streams), args=[group, count, min_idle_ms])
            return [(streams[int(i) - 1], as_text(entry_id), int(n)) for i, entry_id, n in reply or []]
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xpending_range(stream, group, min="-", max="+", count=count, idle=min_idle_ms)
        found: list[tuple[str, str, int]] = []
        for stream, pending in zip(streams, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(pending, Exception):  # NOGROUP: the caller's next read makes the group
                continue
            found += [(stream, as_text(p["message_id"]), int(p["times_delivered"])) for p in pending]
        return found[:count]


def expired_leases(
    redis: Any,
    scanner: ExpiredScanner,
    streams: tuple[str, ...],
    group: str,
    consumer: str,
    count: int,
    min_idle_ms: int,
) -> list[tuple[Entry, int]]:
    """Claim up to `count` entries whose lease expired (their consumer died or stalled), with
    their delivery counts, the streams in order: the scanner lists them, XCLAIM (pipelined)
    takes those still idle (a peer may have taken one in between: XCLAIM returns nothing)."""
    found = scanner.find(streams, group, count, min_idle_ms)
    if not found:
        return []
    pipe = redis.pipeline(transaction=False)
    for stream, entry_id, _ in found:
        pipe.xclaim(stream, group, consumer, min_idle_ms, [entry_id])
    claimed = []
    for (stream, _, delivered), reply in zip(found, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, Exception) or not reply:
            continue
        claimed_id, fields = reply[0]
        if fields is None:  # deleted while pending (acked by a stalled owner)
            continue
        claimed.append((Entry(stream, as_text(claimed_id), fields), delivered + 1))
    return claimed
