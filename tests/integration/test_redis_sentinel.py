"""qworker on Redis with Sentinel: a primary, a replica and three sentinels on loopback ports
(qworker/backends/redis/topologies.py), one worker process (the tiny random Llama) on a
redis+sentinel:// URL. The primary is SIGKILLed mid-run; the sentinels promote the replica, and
the worker rides the failover out: each of the 200 jobs ends with exactly one stored result
(a job may run twice, since replication is asynchronous), nothing is left pending, and the worker
never exits. An unknown service name is one clear line.
"""

from __future__ import annotations

import shutil
import signal
import time
import uuid

import pytest
import redis as redis_lib

from qworker.backends.connections import InvalidURLError, open_sink
from qworker.backends.redis import keys
from qworker.backends.redis.topologies import LocalSentinels
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import spawn_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory):
    topology = LocalSentinels(tmp_path_factory.mktemp("redis-sentinel")).start()
    yield topology
    topology.stop()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except redis_lib.RedisError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def num_results(port: int, prefix: str) -> int:
    r = redis_lib.Redis(port=port, socket_timeout=5)
    try:
        return sum(1 for _ in r.scan_iter(match=f"{prefix}:result:*", count=1000))
    finally:
        r.close()


@pytest.mark.timeout(300)
def test_a_failover_mid_run_loses_no_job(sentinels, tiny_model_dir, tmp_path):
    name = f"qws:{uuid.uuid4().hex[:8]}"
    # A short WAIT: between the promotion and the old primary's return as a replica, the new
    # primary has no replica, and every WAIT runs to its timeout (the run after the failover
    # took some 20 s with 200 ms, 13 s with 50 ms).
    url = f"{sentinels.url}?stream={name}&group=g&prefix={name}&lease_timeout_s=3&wait_timeout_ms=50"
    log_path = tmp_path / "worker.log"
    worker = spawn_worker(url, tiny_model_dir, "sw1", "--log-level", "INFO", log_path=log_path)
    client = Client(queue=url)
    job = {"prompt_token_ids": [1, 520, 3000, 17], "params": {"max_tokens": 24, "ignore_eos": True}}
    try:
        # Half before the failover, half sent across it (however fast the first half runs, the
        # run spans the failover).
        ids = client.submit_many([job] * 100)
        old_port = sentinels.primary.port
        wait_for(lambda: num_results(old_port, name) >= 40, 120, "40 results before the failover")
        sentinels.primary.kill()
        for _ in range(10):
            batch = [{**job, "id": uuid.uuid4().hex} for _ in range(10)]
            while True:
                try:
                    # A retry after a lost reply may enqueue a job twice: same id, one result.
                    client.submit_many(batch)
                    break
                except redis_lib.RedisError:
                    time.sleep(0.2)
            ids += [j["id"] for j in batch]
        wait_for(lambda: sentinels.primary_port() != old_port, 60, "the sentinels to promote the replica")
        new_port = sentinels.primary_port()
        assert new_port == sentinels.replica.port
        # The old primary comes back empty; the sentinels make it the new primary's replica.
        sentinels.primary.start()
        assert worker.poll() is None, log_path.read_text()[-3000:]
        results = client.results(ids, timeout=180)
        assert worker.poll() is None, "the worker never exits"
        assert [r.status for r in results] == [JobStatus.COMPLETED] * 200
        assert num_results(new_port, name) == 200
        r = redis_lib.Redis(port=new_port, socket_timeout=5)
        for lane in (name, keys.high_lane_stream(name)):
            wait_for(
                lambda lane=lane: int(r.xpending(lane, "g")["pending"]) == 0 and r.xlen(lane) == 0,
                30,
                f"nothing pending on {lane}",
            )
        log = log_path.read_text()
        assert "broker unreachable" in log, "the failover was seen"
    finally:
        client.close()
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except Exception:
            worker.kill()
            worker.wait()


# The module's fixture may start within this test's timeout (run alone).
@pytest.mark.timeout(90)
def test_an_unknown_service_name_says_so(sentinels):
    url = sentinels.url.replace(f"/{sentinels.service}/", "/no-such-service/")
    with pytest.raises(InvalidURLError, match="monitor no service 'no-such-service'") as info:
        open_sink(url)
    message = str(info.value)
    assert "\n" not in message and sentinels.service in message
