"""A worker rides out its broker's failures: a private redis-server (AOF, fsync every second) is
killed and restarted under one worker process serving 40 jobs, and an outage longer than
--broker-outage-s ends the worker (exit 5) without losing a job. Real worker processes on a tiny
random Llama.

The jobs of each test ask for different numbers of tokens, so that their results come one or a
few per step and keep coming as an outage begins (with one length, all of them ran in lockstep and
their results came in one burst).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
import urllib.error
import urllib.request
import uuid

import pytest
import redis as redis_lib

from qworker.backends.redis import keys as constants
from qworker.backends.redis.server import RedisServer, free_port
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import spawn_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path / "redis-data").start()
    yield server
    server.stop()


# The first test's jobs, job i asking for MIN_TOKENS + i tokens (the outages come after 10 and 30
# results, while the other jobs' results are still coming), and its second outage's length.
NUM_JOBS, MIN_TOKENS, OUTAGE_S = 40, 16, 6.0


def queue_url(server: RedisServer) -> str:
    name = f"qwtest:broker:{uuid.uuid4().hex[:8]}"
    return f"{server.url}?stream={name}&group=g&prefix={name}"


def job(max_tokens: int) -> dict:
    return {"prompt_token_ids": [1, 520, 3000, 17], "params": {"max_tokens": max_tokens, "ignore_eos": True}}


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


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def num_results(r: redis_lib.Redis, prefix: str) -> int:
    return sum(1 for _ in r.scan_iter(match=f"{prefix}:result:*", count=1000))


def final_stats(log: str) -> dict[str, int]:
    line = [x for x in log.splitlines() if "stopped: WorkerStats(" in x][-1]
    return {k: int(v) for k, v in re.findall(r"\b(num_\w+)=(\d+)", line)}


@pytest.mark.timeout(400)
def test_a_worker_rides_out_two_broker_restarts(server, tiny_model_dir, tmp_path):
    url = queue_url(server)
    prefix = url.rsplit("prefix=", 1)[1]
    metrics_port = free_port()
    log_path = tmp_path / "worker.log"
    worker = spawn_worker(
        url,
        tiny_model_dir,
        "w1",
        "--metrics-port",
        str(metrics_port),
        "--log-level",
        "INFO",
        log_path=log_path,
    )
    client = Client(queue=url)
    try:
        ids = [client.submit(job(MIN_TOKENS + i)) for i in range(NUM_JOBS)]
        r = redis_lib.Redis(port=server.port, socket_timeout=5)
        time.sleep(1.5)  # the jobs are in the AOF (fsync every second)
        # 1: a blip. Restarted as soon as the worker has noticed it (its /readyz says so), so that
        # the outage is certain to be seen however busy the machine is, and stays short.
        wait_for(lambda: num_results(r, prefix) >= 10, 240, "10 results")
        server.kill()
        wait_for(lambda: readyz(metrics_port)[0] == 503, 30, "/readyz to notice the blip")
        server.start()
        # 2: OUTAGE_S away (past the longest retry backoff, 2 s, several times over); the engine
        # keeps generating for the jobs it holds.
        wait_for(lambda: num_results(r, prefix) >= 30, 240, "30 results")
        assert worker.poll() is None
        server.kill()
        down_at = time.monotonic()
        wait_for(lambda: readyz(metrics_port)[0] == 503, 5, "/readyz to say not ready")
        _, body = readyz(metrics_port)
        assert "broker unreachable" in body, body
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
        assert worker.poll() is None, "the worker must not exit during the outage"
        server.start()
        r = redis_lib.Redis(port=server.port, socket_timeout=5)
        wait_for(lambda: readyz(metrics_port)[0] == 200, 30, "/readyz ready again")
        wait_for(lambda: num_results(r, prefix) >= NUM_JOBS, 240, f"all {NUM_JOBS} results")
        assert worker.poll() is None, "the worker never exited"
        results = [Client(queue=url).result(job_id, timeout=10) for job_id in ids[:1]]
        results += Client(queue=url).results(ids[1:], timeout=10)
        stream = url.split("stream=", 1)[1].split("&", 1)[0]
        pending = r.xpending(stream, "g")["pending"]
        dead = r.xlen(constants.dead_letter_stream(stream))
    finally:
        worker.send_signal(signal.SIGTERM)
        returncode = worker.wait(timeout=60)
    log = log_path.read_text()
    assert returncode == 0, log[-3000:]
    assert num_results(r, prefix) == NUM_JOBS
    assert all(res.status is JobStatus.COMPLETED for res in results)
    assert [len(res.token_ids) for res in results] == [MIN_TOKENS + i for i in range(NUM_JOBS)]
    # Running through both outages, nothing restarted: every result is its job's first attempt.
    assert [res.attempts for res in results] == [1] * NUM_JOBS
    stats = final_stats(log)
    assert stats["num_completed"] == NUM_JOBS, stats  # engine completions: none ran twice
    assert stats["num_broker_outages"] >= 2, stats
    assert "broker unreachable" in log and "broker reachable again" in log
    assert (pending, dead) == (0, 0)


# The second test's jobs: one length each, a result every 8 steps.
SECOND_TEST_TOKENS = tuple(16 + 8 * i for i in range(10))


@pytest.mark.timeout(300)
def test_an_outage_past_the_limit_ends_the_worker_and_a_new_one_finishes(server, tiny_model_dir, tmp_path):
    url = queue_url(server)
    prefix = url.rsplit("prefix=", 1)[1]
    limit_s = 6
    common = ("--lease-timeout-s", "3")
    log_path = tmp_path / "first.log"
    first = spawn_worker(
        url, tiny_model_dir, "first", *common, "--broker-outage-s", str(limit_s), log_path=log_path
    )
    second = None
    client = Client(queue=url)
    try:
        # The kill comes after 2 results. Under load the first worker still holds jobs then,
        # whose leases the second takes over once they time out; on a quiet machine it may have
        # stored every result already (all the jobs are done in well under a second).
        ids = [client.submit(job(tokens)) for tokens in SECOND_TEST_TOKENS]
        r = redis_lib.Redis(port=server.port, socket_timeout=5)
        time.sleep(1.5)
        wait_for(lambda: num_results(r, prefix) >= 2, 120, "2 results")
        server.kill()
        down_at = time.monotonic()
        returncode = first.wait(timeout=limit_s + 30)
        exited_after = time.monotonic() - down_at
        log = log_path.read_text()
        assert returncode == 5, log[-3000:]
        assert exited_after < limit_s + 10, exited_after
        assert "--broker-outage-s" in log and "gives up" in log
        server.start()
        second = spawn_worker(url, tiny_model_dir, "second", *common, log_path=tmp_path / "second.log")
        results = Client(queue=url).results(ids, timeout=240)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
    assert all(res.status is JobStatus.COMPLETED for res in results)
    assert [len(res.token_ids) for res in results] == list(SECOND_TEST_TOKENS)
    r = redis_lib.Redis(port=server.port, socket_timeout=5)
    assert num_results(r, prefix) == len(SECOND_TEST_TOKENS)
    assert json.loads(r.get(f"{prefix}:result:{ids[0]}"))["id"] == ids[0]
