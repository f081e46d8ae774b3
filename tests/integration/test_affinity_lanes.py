"""Affinity lanes on the real Redis: where producers write, which worker leases what (owners,
stealing after `steal_after_s`, a dead owner's lanes, the priority lane first), every way a lease
ends across lanes (reclaim, dead letter and replay), the backlog over every lane, mixed versions,
and two in-process workers on the fake engine (qworker/backends/redis/lanes.py, lane_reads.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis as redis_lib

from qworker.backends.connections import InvalidURLError, open_producer, open_sink, open_source, parse_url
from qworker.backends.redis import keys
from qworker.backends.redis.backlog import open_backlog
from qworker.backends.redis.dead_letters import open_dead_letters
from qworker.backends.redis.lanes import lane_index, owned_lanes
from qworker.backends.source import OutgoingJob
from qworker.pool.demand import PoolSizing
from qworker.testing.fake_engine import FakeEngine
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(60)

NUM_LANES = 8


@pytest.fixture
def url():
    base = unique_url(redis_base_url(), "lanes")
    yield f"{base}&affinity_lanes={NUM_LANES}&steal_after_s=0.4"
    redis = redis_lib.Redis.from_url(base.split("?")[0])
    stream = parse_url(base, {"stream", "group", "prefix"}).params["stream"]
    for key in redis.scan_iter(match=f"{stream}*"):
        redis.delete(key)
    cleanup(redis, base)


def redis_of(url: str) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(url.split("?")[0])


def stream_of(url: str) -> str:
    return parse_url(url, {"stream", "group", "prefix", "affinity_lanes", "steal_after_s"}).params["stream"]


def job(job_id: str, affinity: str | None, priority: int = 0) -> OutgoingJob:
    body = {"id": job_id, "prompt": "hello", "params": {"max_tokens": 3, "temperature": 0.0}}
    return OutgoingJob(job_id, json.dumps(body).encode(), priority=priority, affinity=affinity)


def key_owned_by(worker: str, live: list[str], avoid: set[str] = frozenset()) -> str:
    """An affinity key whose lane `worker` owns among `live`."""
    mine = set(owned_lanes(worker, live, NUM_LANES))
    return next(k for i in range(10_000) if lane_index(k := f"key-{i}", NUM_LANES) in mine and k not in avoid)


def joined(url: str, *names: str):
    """Sources for the named workers, each having seen the others' heartbeats."""
    sources = [open_source(url, consumer=name) for name in names]
    for _ in range(2):
        for source in sources:
            source._last_heartbeat = float("-inf")
            source.lease(0, 0.0)  # a heartbeat and nothing else
    assert all(source.live_workers() == frozenset(names) for source in sources)
    return sources


def test_jobs_go_to_their_keys_lane_and_to_the_stream_without_one(url):
    redis, stream = redis_of(url), stream_of(url)
    producer = open_producer(url)
    ids = producer.send([job("a", "tenant-a"), job("b", "tenant-a"), job("none", None)])
    lane = keys.lane_stream(stream, lane_index("tenant-a", NUM_LANES), cluster=False)
    assert redis.xlen(lane) == 2 and redis.xlen(stream) == 1
    assert ids[0].startswith(f"lane{lane_index('tenant-a', NUM_LANES)}:") and ":" not in ids[2]
    assert producer.queue_depth() == 3


def test_owners_lease_their_lanes_and_a_peer_steals_only_what_waited(url):
    a, b = joined(url, "a", "b")
    key_a = key_owned_by("a", ["a", "b"])
    key_b = key_owned_by("b", ["a", "b"])
    open_producer(url).send([job(f"a{i}", key_a) for i in range(4)] + [job(f"b{i}", key_b) for i in range(4)])
    got_a = {le.job_id for le in a.lease(100, 0.0)}
    got_b = {le.job_id for le in b.lease(100, 0.0)}
    assert got_a == {f"a{i}" for i in range(4)} and got_b == {f"b{i}" for i in range(4)}

    # A deep lane of a's while a is busy: b, with room, takes nothing young, then steals.
    open_producer(url).send([job(f"deep{i}", key_a) for i in range(5)])
    assert b.lease(100, 0.0) == []
    time.sleep(0.5)
    stolen = b.lease(3, 0.0)
    assert [le.job_id for le in stolen] == ["deep0", "deep1", "deep2"]  # oldest first, never more
    rest = a.lease(100, 0.0)
    assert [le.job_id for le in rest] == ["deep3", "deep4"]  # nothing leased twice
    assert a.num_pending() == 6 and b.num_pending() == 7


def test_the_priority_lane_comes_before_any_lane(url):
    (a,) = joined(url + "&high_lane_max_priority=0", "a")
    producer = open_producer(url + "&high_lane_max_priority=0")
    producer.send([job(f"own{i}", "k", priority=5) for i in range(3)])
    producer.send([job("urgent", "k", priority=0)])
    producer.send([job("low", None, priority=5)])
    first = a.lease(1, 0.0)
    assert [le.job_id for le in first] == ["urgent"]
    assert first[0].message_id.startswith(keys.HIGH_LANE_PREFIX)
    assert {le.job_id for le in a.lease(10, 0.0)} == {"own0", "own1", "own2", "low"}


def test_a_dead_owners_lanes_are_read_by_the_others(url):
    short = url + "&lease_timeout_s=1.5"
    dead, alive = joined(short, "dead", "alive")
    key = key_owned_by("dead", ["dead", "alive"])
    open_producer(short).send([job(f"j{i}", key) for i in range(3)])
    # Within the steal delay of the jobs' arrival, whatever the heartbeats say.
    deadline = time.monotonic() + 2.0
    got: list[str] = []
    while len(got) < 3 and time.monotonic() < deadline:
        got += [le.job_id for le in alive.lease(10, 0.1)]
    assert sorted(got) == ["j0", "j1", "j2"]
    # Once the dead worker's heartbeat is older than its lease, its lanes are the others' own.
    time.sleep(1.6)
    alive._last_heartbeat = float("-inf")
    alive.lease(0, 0.0)
    assert alive.live_workers() == frozenset({"alive"})
    assert len(alive.reading_order().fair) == NUM_LANES + 1 and alive.reading_order().stealable == ()
    dead.close()


def test_an_expired_lease_on_a_lane_is_reclaimed_with_its_delivery_count(url):
    short = url + "&lease_timeout_s=0.5"
    crashed, peer = joined(short, "crashed", "peer")
    open_producer(short).send([job("x", key_owned_by("crashed", ["crashed", "peer"]))])
    assert [le.job_id for le in crashed.lease(1, 0.0)] == ["x"]
    time.sleep(0.7)
    peer._last_reclaim = 0.0
    reclaimed = peer.lease(5, 0.0)
    assert [(le.job_id, le.delivery_count) for le in reclaimed] == [("x", 2)]
    peer.ack(reclaimed[0])
    assert crashed.extend([reclaimed[0]]) == [reclaimed[0]]  # no longer the crashed one's


def test_dead_letters_backlog_and_replay_cover_every_lane(url):
    redis, stream = redis_of(url), stream_of(url)
    (a,) = joined(url, "a")
    open_producer(url).send([job("lost", "k"), job("plain", None)])
    backlog = open_backlog(url, PoolSizing(), None)
    assert backlog.read(None).waiting.num_jobs == 2
    leases = {le.job_id: le for le in a.lease(10, 0.0)}
    assert backlog.read({"a"}).in_flight.num_jobs == 2
    a.dead_letter(leases["lost"], "broken on purpose")
    a.ack(leases["plain"])
    letters = open_dead_letters(url)
    (letter,) = letters.read()
    lane = keys.lane_stream(stream, lane_index("k", NUM_LANES), cluster=False)
    assert (letter.job_id, letter.source) == ("lost", lane)
    letters.replay([letter.id], None)
    assert redis.xlen(lane) == 1 and letters.read() == []
    assert [le.job_id for le in a.lease(10, 0.0)] == ["lost"]


def test_mixed_versions_and_a_differing_lane_count(url):
    redis, stream = redis_of(url), stream_of(url)
    base = url.replace(f"&affinity_lanes={NUM_LANES}", "")
    open_source(url, consumer="w")  # the first user records 8 lanes
    with pytest.raises(InvalidURLError, match=f"affinity_lanes={NUM_LANES}"):
        open_producer(base)
    with pytest.raises(InvalidURLError, match="affinity_lanes"):
        open_source(base, consumer="w2")
    # A producer that knows no lanes writes the stream itself (a raw XADD, as older ones did):
    # a lane-aware worker reads it as its own.
    redis.xadd(stream, {keys.FIELD_JOB_ID: "old", keys.FIELD_BODY: job("old", None).body})
    (w,) = joined(url, "w")
    assert [le.job_id for le in w.lease(5, 0.0)] == ["old"]
    # A lane-aware producer on a one-lane queue writes the stream, whatever the key.
    one = unique_url(redis_base_url(), "onelane")
    try:
        open_producer(one).send([job("new", "tenant")])
        assert redis.xlen(stream_of(one)) == 1
    finally:
        cleanup(redis, one)
    with pytest.raises(InvalidURLError, match="affinity_lanes must be within"):
        open_producer(base + "&affinity_lanes=0")


def test_two_workers_each_serve_their_keys_and_an_idle_one_steals(url):
    """Fake engines, real Redis: while both are busy each key's jobs go to its lane's owner;
    then, with one worker live but not leasing (its KV full), the other steals its lane."""
    live = ["wa", "wb"]
    key_a, key_b = key_owned_by("wa", live), key_owned_by("wb", live)
    sources = joined(url, *live)
    settings = dict(max_backlog=2, poll_interval_s=0.05, cancel_check_interval_s=0.0)
    workers = [
        Worker(FakeEngine(), source, open_sink(url.split("?")[0]), WorkerSettings(name=name, **settings))
        for source, name in zip(sources, live, strict=True)
    ]
    producer = open_producer(url)
    producer.send([job(f"a{i}", key_a) for i in range(6)] + [job(f"b{i}", key_b) for i in range(6)])
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    sink = open_sink(url.split("?")[0])

    def results(ids: list[str]) -> dict[str, str]:
        deadline = time.monotonic() + 20
        found: dict[str, str] = {}
        while len(found) < len(ids) and time.monotonic() < deadline:
            for job_id in ids:
                result = sink.get_result(job_id)
                if result is not None:
                    found[job_id] = result.worker
            time.sleep(0.05)
        return found

    try:
        done = results([f"a{i}" for i in range(6)] + [f"b{i}" for i in range(6)])
        assert len(done) == 12
        # Each worker's jobs within 0.4 s of their arrival: no steal yet.
        assert {done[f"a{i}"] for i in range(6)} == {"wa"}, done
        assert {done[f"b{i}"] for i in range(6)} == {"wb"}, done
        # wa stops leasing (as if its KV cache were full) but stays live: wb steals its lane.
        workers[0].stop()
        threads[0].join(10)
        sources[0]._last_heartbeat = float("-inf")
        sources[0].lease(0, 0.0)
        producer.send([job(f"late{i}", key_a) for i in range(3)])
        late = results([f"late{i}" for i in range(3)])
        assert set(late.values()) == {"wb"} and len(late) == 3
    finally:
        for w in workers:
            w.stop()
        for thread in threads:
            thread.join(10)


def test_thieves_and_owners_take_the_oldest_entries_first_across_lanes(url):
    a, b = joined(url, "a", "b")
    mine = owned_lanes("b", ["a", "b"], NUM_LANES)
    keys_by_lane: dict[int, str] = {}
    for i in range(10_000):
        lane = lane_index(f"key-{i}", NUM_LANES)
        if lane in mine and lane not in keys_by_lane:
            keys_by_lane[lane] = f"key-{i}"
        if len(keys_by_lane) == 2:
            break
    # Interleaved across two of b's lanes, the higher-numbered lane first.
    high, low = (keys_by_lane[lane] for lane in sorted(keys_by_lane, reverse=True))
    producer = open_producer(url)
    for job_id, key in (("h1", high), ("l1", low), ("h2", high), ("l2", low)):
        producer.send([job(job_id, key)])
        time.sleep(0.002)  # distinct milliseconds: arrival order is the entry ids' order
    time.sleep(0.5)
    assert [le.job_id for le in a.lease(3, 0.0)] == ["h1", "l1", "h2"]  # a thief: the oldest first
    producer.send([job("h3", high)])
    time.sleep(0.002)
    producer.send([job("l3", low)])
    assert [le.job_id for le in b.lease(10, 0.0)] == ["l2", "h3", "l3"]  # the owner too
