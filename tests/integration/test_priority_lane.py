"""The Redis Streams priority lane, piece by piece on the real Redis: where a producer writes,
the order a worker's source reads in, and every way a lease ends (ack, extend, expiry and reclaim
by a peer, release, dead letter and replay), plus the queue depth and pool-demand readings that
must count the lane. End to end with the engine: test_priority_policy.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis as redis_lib

from qworker.backends.connections import InvalidURLError, open_producer, open_source, parse_url
from qworker.backends.redis import keys as constants
from qworker.backends.redis.backlog import RedisStreamBacklog
from qworker.backends.redis.dead_letters import open_dead_letters as open_redis
from qworker.backends.redis.keys import HIGH_LANE_PREFIX
from qworker.backends.source import OutgoingJob
from qworker.pool.demand import PoolSizing
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def url():
    url = unique_url(redis_base_url(), "lane")
    yield url
    cleanup(redis_lib.Redis.from_url(url.split("?")[0]), url)


def stream_of(url: str) -> str:
    return parse_url(url, {"stream", "group", "prefix"}).params["stream"]


def job(job_id: str, priority: int) -> OutgoingJob:
    body = json.dumps({"id": job_id, "prompt": "x", "priority": priority}).encode()
    return OutgoingJob(job_id, body, priority=priority)


def test_producer_writes_urgent_jobs_to_the_lane_only_when_asked(url):
    redis = redis_lib.Redis.from_url(url.split("?")[0])
    stream = stream_of(url)
    lane = constants.high_lane_stream(stream)
    plain = open_producer(url)
    ids = plain.send([job("a", 0), job("b", 9)])
    assert redis.xlen(stream) == 2 and redis.xlen(lane) == 0
    assert not any(i.startswith(HIGH_LANE_PREFIX) for i in ids)

    laned = open_producer(f"{url}&high_lane_max_priority=0")
    ids = laned.send([job("c", -5), job("d", 0), job("e", 1)])
    assert [i.startswith(HIGH_LANE_PREFIX) for i in ids] == [True, True, False]
    assert redis.xlen(stream) == 3 and redis.xlen(lane) == 2
    assert laned.queue_depth() == 5


def test_a_threshold_that_is_not_an_integer_is_refused(url):
    with pytest.raises(InvalidURLError, match="high_lane_max_priority"):
        open_producer(f"{url}&high_lane_max_priority=high")


def test_the_source_reads_the_lane_first_and_acks_each_entry_in_its_own_stream(url):
    redis = redis_lib.Redis.from_url(url.split("?")[0])
    stream = stream_of(url)
    lane = constants.high_lane_stream(stream)
    producer = open_producer(f"{url}&high_lane_max_priority=0")
    producer.send([job(f"low{i}", 9) for i in range(5)])
    producer.send([job("urgent0", 0), job("urgent1", 0)])
    source = open_source(url, consumer="w1")

    first = source.lease(3, 0.0)
    assert [le.job_id for le in first] == ["urgent0", "urgent1", "low0"]
    assert [le.message_id.startswith(HIGH_LANE_PREFIX) for le in first] == [True, True, False]
    assert all(le.delivery_count == 1 and le.enqueued_at for le in first)
    assert source.num_pending() == 3
    for lease in first:
        source.ack(lease)
    assert redis.xlen(lane) == 0 and redis.xlen(stream) == 4
    assert source.num_pending() == 0
    rest = source.lease(10, 0.0)
    assert [le.job_id for le in rest] == [f"low{i}" for i in range(1, 5)]


def test_a_blocking_lease_wakes_for_a_lane_job(url):
    source = open_source(url, consumer="w1")
    producer = open_producer(f"{url}&high_lane_max_priority=0")
    timer = threading.Timer(0.3, lambda: producer.send([job("urgent", 0)]))
    timer.start()
    started = time.monotonic()
    leases = source.lease(4, 5.0)
    timer.join()
    assert [le.job_id for le in leases] == ["urgent"]
    assert time.monotonic() - started < 3.0


def test_same_entry_id_in_both_streams_gives_two_distinct_leases(url):
    """Both streams take ids from the server's clock, so an id can repeat across them."""
    redis = redis_lib.Redis.from_url(url.split("?")[0])
    stream = stream_of(url)
    source = open_source(url, consumer="w1")
    for key, job_id in ((constants.high_lane_stream(stream), "lane"), (stream, "main")):
        redis.xadd(key, {constants.FIELD_JOB_ID: job_id, constants.FIELD_BODY: b"{}"}, id="1-1")
    leases = source.lease(4, 0.0)
    assert [le.job_id for le in leases] == ["lane", "main"]
    assert leases[0].message_id != leases[1].message_id
    assert source.extend(leases) == []
    source.ack(leases[0])
    assert redis.xlen(constants.high_lane_stream(stream)) == 0 and redis.xlen(stream) == 1


def test_expired_lane_leases_are_reclaimed_by_a_peer_first_and_the_owner_learns_it(url):
    producer = open_producer(f"{url}&high_lane_max_priority=0")
    producer.send([job("low", 9), job("urgent", 0)])
    dead = open_source(url, consumer="dead", lease_timeout_s=0.2)
    held = dead.lease(2, 0.0)
    assert [le.job_id for le in held] == ["urgent", "low"]
    time.sleep(0.3)
    peer = open_source(url, consumer="peer", lease_timeout_s=0.2)
    reclaimed = peer.lease(1, 0.0)
    assert [(le.job_id, le.delivery_count) for le in reclaimed] == [("urgent", 2)]
    assert reclaimed[0].message_id == held[0].message_id
    # The first owner extends both: it lost the lane entry, still owns the stream one.
    assert [le.job_id for le in dead.extend(held)] == ["urgent"]


def test_released_lane_entries_go_back_at_once(url):
    producer = open_producer(f"{url}&high_lane_max_priority=0")
    producer.send([job("urgent", 0)])
    first = open_source(url, consumer="first")
    held = first.lease(1, 0.0)
    first.release(held)
    other = open_source(url, consumer="other")
    assert [(le.job_id, le.delivery_count) for le in other.lease(1, 0.0)] == [("urgent", 2)]


def test_a_dead_lettered_lane_job_is_replayed_into_the_lane(url):
    redis = redis_lib.Redis.from_url(url.split("?")[0])
    stream = stream_of(url)
    lane = constants.high_lane_stream(stream)
    open_producer(f"{url}&high_lane_max_priority=0").send([job("urgent", 0), job("low", 9)])
    source = open_source(url, consumer="w1")
    for lease in source.lease(2, 0.0):
        source.dead_letter(lease, "TooLong: test")
    assert redis.xlen(lane) == 0 and redis.xlen(stream) == 0
    dead_letters = open_redis(url)
    letters = {d.job_id: d for d in dead_letters.read()}
    assert letters["urgent"].source == lane and letters["low"].source == stream
    dead_letters.replay(None, None)
    assert redis.xlen(lane) == 1 and redis.xlen(stream) == 1
    assert [le.job_id for le in source.lease(2, 0.0)] == ["urgent", "low"]


def test_pool_demand_counts_waiting_and_held_lane_jobs(url):
    producer = open_producer(f"{url}&high_lane_max_priority=0")
    producer.send([job("urgent0", 0), job("urgent1", 0), job("low", 9)])
    redis = redis_lib.Redis.from_url(url.split("?")[0])
    backlog = RedisStreamBacklog(redis, PoolSizing(), stream=stream_of(url), group="g")
    work = backlog.read(live_workers=None)
    assert work.waiting.num_jobs == 3 and work.in_flight.num_jobs == 0
    source = open_source(url, consumer="w1")
    assert [le.job_id for le in source.lease(1, 0.0)] == ["urgent0"]
    work = backlog.read(live_workers={"w1"})
    assert (work.waiting.num_jobs, work.in_flight.num_jobs) == (2, 1)


def test_hostile_entries_in_the_lane_are_each_answered_and_the_good_ones_run(url):
    """Whatever a producer writes straight into the lane, the worker reading it first neither
    stops nor stalls: each entry gets its one outcome (a result, or a dead letter with a reason)."""
    from qworker.backends.connections import open_sink
    from qworker.jobs.job import JobStatus
    from qworker.testing.fake_engine import FakeEngine
    from qworker.worker.loop import Worker
    from qworker.worker.settings import WorkerSettings

    redis = redis_lib.Redis.from_url(url.split("?")[0])
    stream = stream_of(url)
    lane = constants.high_lane_stream(stream)
    good = {"id": "good", "prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 3}}
    entries = [
        # The body's id gets the failed result (Rejected), as on the stream itself.
        {constants.FIELD_JOB_ID: b"\xff\xfe-not-utf8", constants.FIELD_BODY: json.dumps(
            {**good, "id": "bad-id"}
        ).encode()},
        {constants.FIELD_JOB_ID: "bad-json", constants.FIELD_BODY: b"\xff{not json"},
        {constants.FIELD_JOB_ID: "absurd", constants.FIELD_BODY: json.dumps(
            {"id": "absurd", "prompt": "x", "priority": 10**30, "params": {"max_tokens": -5}}
        ).encode()},
        {"unrelated": "field"},
        {constants.FIELD_JOB_ID: "good", constants.FIELD_BODY: json.dumps(good).encode()},
    ]  # fmt: skip
    for fields in entries:
        redis.xadd(lane, fields)
    redis.xadd(stream, {constants.FIELD_JOB_ID: "main", constants.FIELD_BODY: json.dumps(
        {**good, "id": "main"}
    ).encode()})  # fmt: skip

    worker = Worker(
        FakeEngine(),
        open_source(url, consumer="w"),
        open_sink(url),
        WorkerSettings(name="w", max_backlog=4, poll_interval_s=0.01),
    )
    stats = worker.run(burst=True)
    sink = open_sink(url)
    assert sink.get_result("good").status is JobStatus.COMPLETED
    assert sink.get_result("main").status is JobStatus.COMPLETED
    assert sink.get_result("absurd").status is JobStatus.FAILED
    assert sink.get_result("bad-json").status is JobStatus.FAILED
    rejected = sink.get_result("bad-id")
    assert rejected.status is JobStatus.FAILED and rejected.error.type == "Rejected"
    assert stats.num_completed == 2
    # Nothing is left in either stream or pending. Invalid jobs get failed results; the two
    # entries that name no usable id (id not UTF-8, no id or body at all) are dead letters too.
    assert redis.xlen(lane) == 0 and redis.xlen(stream) == 0
    for key in (lane, stream):
        assert int(redis.xpending(key, "g")["pending"]) == 0
    letters = open_redis(url).read()
    assert len(letters) == 2, letters
    assert all(d.reason and d.source == lane for d in letters)
    # The entry with no body says so, instead of calling a missing body "not a JSON object".
    assert any("neither a 'job' nor an 'id' field (its fields: 'unrelated')" in d.reason for d in letters), [
        d.reason for d in letters
    ]
