"""Reading a queue's streams in a worker's reading order (lanes.py): new entries, and entries
whose lease expired.

On one server (redis://, Sentinel) one script reads every stream in one round trip. On a cluster
the lanes sit in different slots and no script may span them, so the same order is read with
pipelines: one round trip to see which lanes hold entries, then one per round of reads (most
reads take one round), and for stealing two more (where each lane's next entry is, and how old).

Both readers take, in order: the priority lane (up to the count), then the fair streams (the
worker's own lanes and the shared stream) an equal share each in turn until the count is met or
they are empty, then the stealable lanes' entries that have waited `steal_after_ms`, oldest lane
first in the order given. They never take more than the count.
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
left = left - take(1, left)
local turn = {}
for i = 2, num_fair + 1 do
  if redis.call('XLEN', KEYS[i]) > 0 then turn[#turn + 1] = i end
end
while left > 0 and #turn > 0 do
  local share = math.max(1, math.floor(left / #turn))
  local again = {}
  for _, i in ipairs(turn) do
    if left > 0 then
      local got = take(i, math.min(share, left))
      left = left - got
      if got == share then again[#again + 1] = i end
    end
  end
  turn = again
end
if left > 0 and #KEYS > num_fair + 1 then
  local now = redis.call('TIME')
  local cutoff = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - steal_after_ms
  for i = num_fair + 2, #KEYS do
    if left <= 0 then break end
    if redis.call('XLEN', KEYS[i]) > 0 then
      local last = nil
      for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[i])) do
        local info = {}
        for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
        if info['name'] == group then last = info['last-delivered-id'] end
      end
      if last then
        local ready = 0
        for _, entry in ipairs(redis.call('XRANGE', KEYS[i], '(' .. last, '+', 'COUNT', left)) do
          if tonumber(string.match(entry[1], '^(%d+)')) > cutoff then break end
          ready = ready + 1
        end
        if ready > 0 then left = left - take(i, ready) end
      end
    end
  end
end
return out
"""


@dataclass(frozen=True)
class Entry:
    stream: str
    entry_id: str
    fields: dict[Any, Any]


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
        entries = []
        for index, entry_id, flat in reply or []:
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            entries.append(Entry(streams[int(index) - 1], as_text(entry_id), fields))
        return entries


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
        turn = [s for s in order.fair if sizes[s] > 0]
        while left > 0 and turn:
            share = max(1, left // len(turn))
            counts = dict(zip(turn, [share] * len(turn), strict=True))
            # Never more than asked: the first lanes take the shares that fit.
            while sum(counts.values()) > left:
                counts.popitem()
            got = self._take(counts)
            entries += got
            left -= len(got)
            taken = {s: sum(e.stream == s for e in got) for s in counts}
            turn = [s for s in counts if taken[s] == counts[s]]
        stealable = [s for s in order.stealable if sizes[s] > 0]
        if left > 0 and stealable:
            entries += self._steal(stealable, left, steal_after_ms)
        return entries

    def _steal(self, lanes: list[str], left: int, steal_after_ms: int) -> list[Entry]:
        pipe = self.redis.pipeline(transaction=False)
        for lane in lanes:
            pipe.xinfo_groups(lane)
        last_ids: dict[str, str] = {}
        for lane, groups in zip(lanes, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(groups, Exception):
                continue
            for group in groups:
                if as_text(group["name"]) == self.group:
                    last_ids[lane] = as_text(group["last-delivered-id"])
        pipe = self.redis.pipeline(transaction=False)
        for lane, last_id in last_ids.items():
            pipe.xrange(lane, f"({last_id}", "+", count=left)
        cutoff_ms = int(time.time() * 1000) - steal_after_ms
        counts: dict[str, int] = {}
        for lane, waiting in zip(last_ids, pipe.execute(), strict=True):
            ready = 0
            for entry_id, _ in waiting:
                if int(as_text(entry_id).split("-")[0]) > cutoff_ms:
                    break
                ready += 1
            ready = min(ready, left - sum(counts.values()))
            if ready > 0:
                counts[lane] = ready
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
