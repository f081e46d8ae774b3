"""qworker on a real 3-primary Redis Cluster on loopback ports (qworker/backends/redis/topologies.py):
jobs through the stream and its priority lane, streaming, cancel, dead letters and their replay
through `qworker dlq`, the SIGKILL of a worker holding jobs, and a slot migration of the queue's
slot to another node mid-run. One cluster and one worker process (the tiny random Llama) for the
module; every test checks that each of its jobs has exactly one result and that nothing is left
pending. The bad-configuration lines (a cluster URL at a single server, an old-layout stream on
the cluster) are checked here too.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import uuid

import pytest
import redis as redis_lib
from redis.crc import key_slot
from typer.testing import CliRunner

from qworker.backends.connections import InvalidURLError, open_producer, open_sink, open_source
from qworker.backends.redis import keys
from qworker.backends.redis.results import WORKER_STATS_TTL_S
from qworker.backends.redis.topologies import LocalCluster
from qworker.backends.source import OutgoingJob
from qworker.cli import app
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import redis_base_url, spawn_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]

STREAM = "qwc:jobs"
PREFIX = "qwc"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def url(cluster) -> str:
    # A short lease: a killed worker's jobs go to its peer within seconds.
    return (
        f"{cluster.url}?stream={STREAM}&group=g&prefix={PREFIX}&lease_timeout_s=3&high_lane_max_priority=-1"
    )


@pytest.fixture(scope="module")
def worker(url, tiny_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("cluster-worker") / "worker.log"
    process = spawn_worker(
        url,
        tiny_model_dir,
        "cw1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--log-level",
        "INFO",
        log_path=log_path,
    )
    yield process, log_path
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except Exception:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def node_client(cluster):
    client = redis_lib.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, socket_timeout=10)
    yield client
    client.close()


def job(max_tokens: int = 8, **extra) -> dict:
    return {
        "prompt_token_ids": [1, 520, 3000, 17],
        "params": {"max_tokens": max_tokens, "ignore_eos": True},
        **extra,
    }


def stream_key() -> str:
    return "{" + STREAM + "}"


def assert_clean(node_client, worker) -> None:
    """Nothing pending, nothing left in the stream or its lane, and the worker still up."""
    for lane in (stream_key(), keys.high_lane_stream(stream_key())):
        deadline = time.monotonic() + 30
        while True:
            pending = int(node_client.xpending(lane, "g")["pending"])
            length = int(node_client.xlen(lane))
            if (pending, length) == (0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (pending, length) == (0, 0), f"{lane}: {pending} pending, {length} entries"
    assert worker[0].poll() is None, worker[1].read_text()[-3000:]


def done_markers(node_client, job_id: str) -> int:
    key = keys.delta_stream_key(PREFIX, keys.CLUSTER.job(job_id))
    return sum(1 for _, fields in node_client.xrange(key) if keys.DELTA_FIELD_DONE.encode() in fields)


@pytest.mark.timeout(120)
def test_jobs_through_the_stream_and_the_priority_lane(url, worker, node_client):
    producer = open_producer(url)
    ids = [f"lane-{uuid.uuid4().hex[:8]}-{i}" for i in range(24)]
    outgoing = [
        OutgoingJob(
            job_id=i,
            body=json.dumps({"id": i, **job(priority=-5 if n % 3 == 0 else 0)}).encode(),
            priority=-5 if n % 3 == 0 else 0,
        )
        for n, i in enumerate(ids)
    ]
    message_ids = producer.send(outgoing)
    producer.close()
    # A third went through the lane; both lanes share the queue's slot, and the jobs' keys spread.
    assert sum(m.startswith(keys.HIGH_LANE_PREFIX) for m in message_ids) == 8
    assert key_slot(stream_key().encode()) == key_slot(keys.high_lane_stream(stream_key()).encode())
    client = Client(queue=url)
    results = client.results(ids, timeout=60)
    assert [r.status for r in results] == [JobStatus.COMPLETED] * len(ids)
    assert len({key_slot(keys.result_key(PREFIX, keys.CLUSTER.job(i)).encode()) for i in ids}) > 10
    assert all(done_markers(node_client, i) == 1 for i in ids)
    client.close()
    assert_clean(node_client, worker)


@pytest.mark.timeout(120)
def test_streaming_and_cancel(url, worker, node_client):
    client = Client(queue=url)
    job_id = client.submit(job(48))
    text = "".join(client.stream(job_id, timeout=60))
    result = client.result(job_id, timeout=10)
    assert (
        result.status is JobStatus.COMPLETED and text == result.text and result.usage.completion_tokens == 48
    )
    # Cancel a long job once it has streamed something (its cancel flag sits in its own slot).
    long_id = client.submit(job(MAX_MODEL_LEN - 8))
    pieces = client.stream(long_id, timeout=60)
    next(pieces)
    client.cancel(long_id)
    cancelled = client.result(long_id, timeout=60)
    assert cancelled.status is JobStatus.CANCELLED, cancelled
    assert cancelled.usage.completion_tokens < MAX_MODEL_LEN - 8
    client.close()
    assert_clean(node_client, worker)


@pytest.mark.timeout(120)
def test_dead_letters_and_their_replay(url, worker, node_client):
    client = Client(queue=url)
    too_long = {"prompt_token_ids": list(range(10, 10 + MAX_MODEL_LEN + 20)), "params": {"max_tokens": 4}}
    job_id = client.submit(too_long)
    first = client.result(job_id, timeout=60)
    assert first.status is JobStatus.FAILED
    # An entry with neither a body nor an id: dead-lettered by the worker in the queue's slot.
    node_client.xadd(stream_key(), {"junk": "1"})
    runner = CliRunner()
    deadline = time.monotonic() + 30
    while True:
        listed = runner.invoke(app, ["dlq", "list", "--queue", url, "--json"])
        assert listed.exit_code == 0, listed.output
        letters = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
        if len(letters) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(str(letter.get("job_id")) for letter in letters) == sorted([job_id, "None"]), letters
    # Replay the job's letter: its failed result is removed, it runs again and is dead-lettered
    # again (the context is still too short), with one result and one letter for it.
    ours = next(letter for letter in letters if letter.get("job_id") == job_id)
    replayed = runner.invoke(app, ["dlq", "replay", "--queue", url, ours["id"]])
    assert replayed.exit_code == 0, replayed.output
    again = client.result(job_id, timeout=60)
    assert again.status is JobStatus.FAILED and again.attempts == 1
    purged = runner.invoke(app, ["dlq", "purge", "--queue", url, "--yes"])
    assert purged.exit_code == 0, purged.output
    client.close()
    assert_clean(node_client, worker)


@pytest.mark.timeout(180)
def test_a_killed_worker_loses_nothing(url, worker, node_client, tiny_model_dir, tmp_path):
    victim = spawn_worker(
        url,
        tiny_model_dir,
        "cw-victim",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        log_path=tmp_path / "victim.log",
    )
    client = Client(queue=url)
    try:
        ids = client.submit_many([job(96) for _ in range(40)])

        def victim_holds() -> int:
            consumers = node_client.xpending(stream_key(), "g").get("consumers") or []
            return sum(int(c["pending"]) for c in consumers if c["name"] in (b"cw-victim", "cw-victim"))

        deadline = time.monotonic() + 60
        while victim_holds() == 0:
            assert time.monotonic() < deadline, "the victim never held a job"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        results = client.results(ids, timeout=120)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert [r.status for r in results] == [JobStatus.COMPLETED] * len(ids)
    assert [done_markers(node_client, i) for i in ids] == [1] * len(ids)
    client.close()
    assert_clean(node_client, worker)


@pytest.mark.timeout(180)
def test_the_queue_slot_moves_to_another_node_mid_run(url, cluster, worker, node_client):
    slot = key_slot(stream_key().encode())
    client = Client(queue=url)
    ids = client.submit_many([job(24) for _ in range(60)])
    time.sleep(0.5)
    source = cluster.owner_of(slot)
    target = next(node for node in cluster.nodes if node is not source)
    # One key at a time with a pause, so that the worker meets the slot half moved (ASK).
    moved = cluster.migrate_slot(slot, target, batch=1, pause_s=0.5)
    assert moved >= 1 and cluster.owner_of(slot) is target
    more = client.submit_many([job(8) for _ in range(20)])
    results = client.results(ids + more, timeout=120)
    assert [r.status for r in results] == [JobStatus.COMPLETED] * len(results)
    assert all(done_markers(node_client, i) == 1 for i in ids + more)
    client.close()
    assert_clean(node_client, worker)


@pytest.mark.timeout(60)
def test_a_cluster_url_at_a_single_server_says_so():
    with pytest.raises(InvalidURLError, match="not a cluster") as info:
        open_sink(redis_base_url().replace("redis://", "redis+cluster://", 1) + "?prefix=x")
    assert "\n" not in str(info.value) and "use redis://" in str(info.value)


@pytest.mark.timeout(120)
def test_an_old_layout_stream_on_the_cluster_says_what_to_do(cluster, node_client):
    name = f"qwc:old:{uuid.uuid4().hex[:6]}"
    node_client.xadd(name, {"id": "j", "job": "{}"})
    try:
        with pytest.raises(InvalidURLError, match="single-server key layout") as info:
            open_source(f"{cluster.url}?stream={name}", "c")
        message = str(info.value)
        assert "\n" not in message and "{" + name + "}" in message and "drain it" in message
    finally:
        node_client.delete(name)


@pytest.mark.timeout(120)
def test_a_batch_runs_record_of_submitted_jobs_lives_on_the_cluster(url, tmp_path):
    """`qworker batch --queue` keeps the ids it enqueued in the result store (one set), so that a
    rerun enqueues nothing twice: on a cluster too."""
    from qworker.openai.batches.submitted import RedisSubmitted, open_submitted

    batch_id = uuid.uuid4().hex[:8]
    sink = open_sink(url)
    record = open_submitted(sink, batch_id, tmp_path / "journal")
    assert isinstance(record, RedisSubmitted)
    record.add(["a", "b{c}", "d"])
    again = open_submitted(open_sink(url), batch_id, tmp_path / "journal")
    assert {"a", "b{c}", "d"} <= again.ids and "e" not in again
    again.clear()
    sink.close()


# The module's fixtures start (and, as the last test, stop) within a test's timeout.
@pytest.mark.timeout(180)
def test_the_pool_demand_exporter_reads_a_queue_and_the_worker_reports_on_the_cluster(cluster, worker):
    """A queue no worker serves: its waiting jobs are read from its slot, and the live worker's
    stats report (in its own slot) is found by the SCAN over every node."""
    from qworker.pool.demand import PoolSizing
    from qworker.pool.exporter import open_pool_demand_reader

    idle = f"{cluster.url}?stream=qwc:idle:{uuid.uuid4().hex[:6]}&group=g&prefix={PREFIX}"
    client = Client(queue=idle)
    client.submit_many([job(8) for _ in range(5)])
    reader = open_pool_demand_reader(idle, PoolSizing())
    try:
        # The worker SIGKILLed by an earlier test left its report behind; it lives out its TTL.
        deadline = time.monotonic() + WORKER_STATS_TTL_S + 15
        while True:
            demand = reader.read()
            if reader.num_workers == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert demand.waiting.num_jobs == 5
        assert reader.num_workers == 1 and reader.reported_capacity_blocks
    finally:
        reader.close()
        client.close()


def test_affinity_lanes_spread_over_the_nodes_and_are_read_with_pipelines(cluster):
    """Lanes on a cluster: each its own hash tag (slots on several nodes), read without a script
    spanning slots: own lanes and the stream, stealing what waited, reclaim, dead letters."""
    from qworker.backends.redis.backlog import open_backlog
    from qworker.backends.redis.dead_letters import open_dead_letters
    from qworker.backends.redis.lanes import lane_index, owned_lanes
    from qworker.pool.demand import PoolSizing

    name = f"qwc:lanes:{uuid.uuid4().hex[:6]}"
    lane_url = (
        f"{cluster.url}?stream={name}&group=g&prefix=qwc&affinity_lanes=4&steal_after_s=0.3&lease_timeout_s=1"
    )
    producer = open_producer(lane_url)
    lanes = producer.streams.lanes
    assert len({key_slot(lane.encode()) for lane in lanes}) == 4
    a, b = open_source(lane_url, consumer="a"), open_source(lane_url, consumer="b")
    for source in (a, b, a):
        source._last_heartbeat = float("-inf")
        source.lease(0, 0.0)
    assert a.live_workers() == {"a", "b"}
    mine = set(owned_lanes("a", ["a", "b"], 4))
    key_a = next(k for i in range(1000) if lane_index(k := f"k{i}", 4) in mine)
    body = json.dumps({"prompt": "hi"}).encode()
    producer.send([OutgoingJob(f"j{i}", body, affinity=key_a) for i in range(3)])
    assert b.lease(10, 0.0) == []  # young entries of a's lane
    got = {le.job_id: le for le in a.lease(10, 0.0)}
    assert set(got) == {"j0", "j1", "j2"}
    backlog = open_backlog(lane_url, PoolSizing(), None)
    assert backlog.read({"a", "b"}).in_flight.num_jobs == 3
    a.dead_letter(got["j0"], "on purpose")
    for job_id in ("j1", "j2"):
        a.ack(got[job_id])
    letters = open_dead_letters(lane_url)
    (letter,) = [d for d in letters.read() if d.job_id == "j0"]
    letters.replay([letter.id], None)
    time.sleep(0.35)
    (stolen,) = b.lease(5, 0.0)  # j0 is back on a's lane and has waited: b steals it
    assert stolen.job_id == "j0"
    time.sleep(1.1)  # b "dies" holding it; a reclaims it across the lanes' slots
    a._last_reclaim = 0.0
    reclaimed = a.lease(5, 0.0)
    assert [(le.job_id, le.delivery_count) for le in reclaimed] == [("j0", 2)]
    a.ack(reclaimed[0])
    assert backlog.read({"a", "b"}).in_flight.num_jobs == 0
