"""Affinity lanes without a server: the keys jobs derive, the lane a key hashes to, rendezvous
ownership (every lane has one owner, a worker joining or leaving moves about 1/N of them), the
reading order and message ids (qworker/backends/redis/lanes.py, qworker/jobs/affinity.py)."""

from __future__ import annotations

import pytest

from qworker.backends.redis.lanes import (
    QueueStreams,
    lane_index,
    lane_owner,
    owned_lanes,
    reading_order,
)
from qworker.jobs import affinity
from qworker.jobs.job import Job, JobDecodeError, decode_job

pytestmark = pytest.mark.timeout(30)

NUM_LANES = 256


def workers(n: int) -> list[str]:
    return [f"worker-{i}" for i in range(n)]


def owners(live: list[str]) -> dict[int, str | None]:
    return {lane: lane_owner(lane, live) for lane in range(NUM_LANES)}


@pytest.mark.parametrize("num_workers", [1, 2, 8, 64])
def test_every_lane_has_one_owner_and_shares_are_even(num_workers):
    live = workers(num_workers)
    by_lane = owners(live)
    assert set(by_lane.values()) <= set(live) and None not in by_lane.values()
    owned = {w: owned_lanes(w, live, NUM_LANES) for w in live}
    assert sorted(lane for lanes in owned.values() for lane in lanes) == list(range(NUM_LANES))
    if num_workers <= 8:  # 32 lanes a worker or more: shares within a factor of about 2
        share = NUM_LANES / num_workers
        assert all(0.4 * share <= len(lanes) <= 1.7 * share for lanes in owned.values()), owned


@pytest.mark.parametrize("num_workers", [2, 8, 64])
def test_a_worker_joining_or_leaving_moves_only_its_own_share(num_workers):
    live = workers(num_workers)
    before = owners(live)
    joined = owners([*live, "newcomer"])
    moved = [lane for lane in range(NUM_LANES) if before[lane] != joined[lane]]
    # Every moved lane went to the newcomer, and about 1/(N+1) of them moved.
    assert all(joined[lane] == "newcomer" for lane in moved)
    assert len(moved) <= 2.5 * NUM_LANES / (num_workers + 1) + 4
    left = owners(live[1:])
    moved = [lane for lane in range(NUM_LANES) if before[lane] != left[lane]]
    assert {before[lane] for lane in moved} <= {live[0]}
    assert moved == [lane for lane in range(NUM_LANES) if before[lane] == live[0]]


def test_a_key_always_hashes_to_the_same_lane():
    # Fixed values: a producer in another language follows the same rule (docs/queues.md).
    assert [lane_index(key, 64) for key in ("tenant-a", "tenant-b", "é")] == [
        lane_index("tenant-a", 64),
        lane_index("tenant-b", 64),
        lane_index("é", 64),
    ]
    import hashlib

    digest = int.from_bytes(hashlib.blake2b(b"tenant-a", digest_size=8).digest(), "big")
    assert lane_index("tenant-a", 64) == digest % 64
    spread = {lane_index(f"key{i}", 16) for i in range(400)}
    assert spread == set(range(16))


def test_message_ids_name_their_stream_and_round_trip():
    streams = QueueStreams.of("jobs", 4, cluster=False)
    assert streams.all == ("jobs:high", "jobs", "jobs:lane:0", "jobs:lane:1", "jobs:lane:2", "jobs:lane:3")
    for stream in streams.all:
        message_id = streams.message_id(stream, "1700000000000-3")
        assert streams.locate(message_id) == (stream, "1700000000000-3")
    assert streams.message_id("jobs", "1-0") == "1-0"
    assert streams.message_id("jobs:lane:2", "1-0") == "lane2:1-0"
    with pytest.raises(ValueError, match="lane"):
        streams.locate("lane9:1-0")


def test_one_lane_is_todays_layout_and_a_cluster_tags_each_lane():
    plain = QueueStreams.of("jobs", 1, cluster=False)
    assert plain.all == ("jobs:high", "jobs") and plain.for_job("any", is_urgent=False) == "jobs"
    cluster = QueueStreams.of("{jobs}", 3, cluster=True)
    assert cluster.lanes == ("{jobs:lane:0}", "{jobs:lane:1}", "{jobs:lane:2}")
    assert cluster.high == "{jobs}:high"
    with pytest.raises(ValueError, match="affinity_lanes"):
        QueueStreams.of("jobs", 0, cluster=False)


def test_where_a_producer_writes():
    streams = QueueStreams.of("jobs", 8, cluster=False)
    assert streams.for_job("k", is_urgent=True) == "jobs:high"
    assert streams.for_job(None, is_urgent=False) == "jobs"
    assert streams.for_job("k", is_urgent=False) == f"jobs:lane:{lane_index('k', 8)}"


def test_the_reading_order_is_the_priority_lane_own_lanes_and_the_stream_then_the_rest():
    streams = QueueStreams.of("jobs", 16, cluster=False)
    live = ["a", "b"]
    order = reading_order(streams, "a", live, 0)
    own = {f"jobs:lane:{i}" for i in owned_lanes("a", live, 16)}
    assert order.urgent == "jobs:high"
    assert set(order.fair) == own | {"jobs"}
    assert set(order.stealable) == set(streams.lanes) - own
    turned = reading_order(streams, "a", live, 1)
    assert turned.fair == order.fair[1:] + order.fair[:1]
    alone = reading_order(streams, "a", ["a"], 0)
    assert alone.stealable == () and len(alone.fair) == 17


# -- the affinity key -------------------------------------------------------------------------

LONG = "You are grading answers. " * 200  # well past the 2,048 characters looked at


def test_a_named_key_wins_and_a_derived_key_follows_the_prompts_start():
    assert affinity.affinity_key(Job(prompt="short", affinity="tenant-7")) == "tenant-7"
    a = affinity.affinity_key(Job(prompt=LONG + "question one"))
    b = affinity.affinity_key(Job(prompt=LONG + "question two"))
    assert a is not None and a == b and a.startswith("prefix:")
    assert affinity.affinity_key(Job(prompt="x" * 63)) is None  # shorter than a block
    assert affinity.affinity_key(Job(prompt="x" * 64)) is not None
    chat_a = Job(messages=[{"role": "system", "content": LONG}, {"role": "user", "content": "1"}])
    chat_b = Job(messages=[{"role": "system", "content": LONG}, {"role": "user", "content": "2"}])
    assert affinity.affinity_key(chat_a) == affinity.affinity_key(chat_b) is not None
    assert affinity.affinity_key(Job(prompt=LONG)) != affinity.affinity_key(chat_a)
    ids = list(range(600))
    assert affinity.affinity_key(Job(prompt_token_ids=ids)) == affinity.affinity_key(
        Job(prompt_token_ids=[*ids, 7])
    )
    assert affinity.affinity_key(Job(prompt_token_ids=list(range(15)))) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (7, "affinity"),
        (["a"], "affinity"),
        ("", "affinity is empty"),
        ("é" * 129, "258 bytes"),
        ("\ud800", "not valid Unicode"),
    ],
)
def test_a_bad_affinity_fails_the_job_naming_the_field(value, message):
    import json

    body = json.dumps({"prompt": "hi", "affinity": value}).encode()
    with pytest.raises(JobDecodeError, match=message) as info:
        decode_job(body, "job-1")
    assert "affinity" in info.value.message
    assert decode_job(json.dumps({"prompt": "hi", "affinity": "é" * 128}).encode(), "j").affinity
