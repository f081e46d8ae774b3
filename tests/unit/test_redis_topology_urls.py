"""Redis Cluster and Sentinel URLs and the cluster key layout, offline (the servers are in
tests/integration/test_redis_cluster.py and test_redis_sentinel.py)."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from qworker.backends.redis import keys
from qworker.backends.redis.cluster import node_urls
from qworker.backends.redis.connection import durability, key_layout, parse_redis_url
from qworker.backends.urls import InvalidURLError


def test_the_cluster_layout_puts_a_queue_in_one_slot_and_a_job_in_one_slot():
    stream = keys.CLUSTER.stream("qworker:jobs")
    assert stream == "{qworker:jobs}"
    lane, dead = keys.high_lane_stream(stream), keys.dead_letter_stream(stream)
    assert key_slot(stream.encode()) == key_slot(lane.encode()) == key_slot(dead.encode())
    # A name with a tag of its own is used as given.
    assert keys.CLUSTER.stream("{jobs}:eu") == "{jobs}:eu"
    for job_id in ("abc", "a}b", "}x", "{", "{}", "x{y}z"):
        tagged = keys.CLUSTER.job(job_id)
        names = [
            key_of("qworker", tagged)
            for key_of in (keys.result_key, keys.delta_stream_key, keys.cancel_key, keys.last_error_key)
        ]
        assert len({key_slot(n.encode()) for n in names}) == 1, job_id
        assert job_id in tagged
    assert keys.CLUSTER.job("a}b") != keys.CLUSTER.job("a}c")


def test_the_single_server_layout_keeps_the_old_names():
    assert keys.SINGLE_SERVER.stream("qworker:jobs") == "qworker:jobs"
    assert keys.SINGLE_SERVER.job("abc") == "abc"
    assert key_layout("redis://h:6379/0") is keys.SINGLE_SERVER
    assert key_layout("redis+sentinel://s:26379/svc/0") is keys.SINGLE_SERVER
    assert key_layout("redis+cluster://a:1,b:2/0") is keys.CLUSTER
    assert key_layout("rediss+cluster://a:1/0") is keys.CLUSTER


def test_node_lists_parse_with_default_ports_and_keep_credentials():
    nodes, first = node_urls("redis+cluster://u:pw@a:7000,b,c:7002/0?socket_timeout=3", "redis", 6379)
    assert nodes == [("a", 7000), ("b", 6379), ("c", 7002)]
    assert first == "redis://u:pw@a:7000/0?socket_timeout=3"
    with pytest.raises(InvalidURLError, match="bad host list"):
        node_urls("redis+cluster://a:1,:2/0", "redis", 6379)


def test_wait_defaults_to_one_replica_under_sentinel_only():
    assert durability(parse_redis_url("redis+sentinel://s:26379/svc/0?stream=x")).replicas == 1
    assert durability(parse_redis_url("redis://h:6379/0")).replicas == 0
    assert durability(parse_redis_url("redis+cluster://a:1/0")).replicas == 0
    chosen = durability(parse_redis_url("redis://h:6379/0?wait_replicas=2&wait_timeout_ms=50"))
    assert (chosen.replicas, chosen.timeout_ms) == (2, 50)


def test_an_unknown_parameter_on_a_cluster_url_is_named():
    with pytest.raises(InvalidURLError, match="'bogus'"):
        parse_redis_url("redis+cluster://a:1/0?bogus=1")
