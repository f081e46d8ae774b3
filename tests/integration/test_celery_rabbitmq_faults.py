"""Celery on RabbitMQ under faults, with real `qworker worker` processes on a private RabbitMQ node
(this module's own port, node name and data directory):

- SIGKILL of one of two workers with 20 tasks in flight: the broker requeues the killed worker's
  unacked deliveries when its socket closes (no lease timeout to wait out), the peer runs them,
  and every task completes exactly once.
- The node restarted mid-run: the worker's channel dies with it, it reconnects when the node is
  back, the durable queue's persistent messages are still there, and nothing is lost or duplicated.

The kill test's surviving worker (the peer) is the restart test's worker too, on the same queue:
one worker start fewer; the restart test reads only what the peer logged after it began.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import pytest

from qworker.testing.worker_kit import spawn_worker
from tests.integration import rabbitmq_node
from tests.integration.celery_rabbitmq_support import (
    RESULTS,
    TASK,
    amqp_url,
    celery_app,
    forget,
    new_queue,
    queue_counts,
    results_redis,
    task_queue,
)
from tests.integration.conftest import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not rabbitmq_node.is_available(), reason="needs rabbitmq-server installed"),
]


@pytest.fixture(scope="module")
def node():
    node = rabbitmq_node.RabbitNode().start()
    yield node
    node.close()


@pytest.fixture(scope="module")
def store():
    r = results_redis()
    if r is None:
        pytest.fail("the suite's Redis server (the Celery result backend) does not answer")
    return r


def job(max_tokens: int, first: int) -> dict:
    return {"prompt_token_ids": [first, 6, 7], "params": {"max_tokens": max_tokens, "ignore_eos": True}}


def stop(*processes) -> None:
    for process in processes:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        if process is not None:
            assert process.wait(timeout=60) == 0


@dataclass
class Peer:
    """A worker on the module's queue, up for both tests."""

    queue: str
    url: str
    process: Popen
    log_path: Path


# Every worker's flags: backlog 4, so that each holds a few tasks; an outage limit well past a
# node restart.
WORKER_ARGS = (
    "--results",
    RESULTS,
    "--num-kv-blocks",
    "256",
    "--max-backlog",
    "4",
    "--broker-outage-s",
    "120",
)


@pytest.fixture(scope="module")
def peer(node, tiny_model_dir, tmp_path_factory):
    queue = new_queue("faults")
    url = amqp_url(node.port, queue)
    log_path = tmp_path_factory.mktemp("celery-faults") / "peer.log"
    process = spawn_worker(url, tiny_model_dir, "peer", *WORKER_ARGS, log_path=log_path)
    try:
        yield Peer(queue, url, process, log_path)
    finally:
        stop(process)


# Tokens of each task in the kill test: the victim's tasks are still running when the kill comes
# (it follows the first moment both workers hold tasks, within a poll of 0.05 s; the victim runs
# all it holds at once, so that they end together, 64 decode steps after they start).
KILL_TOKENS = 64


@pytest.mark.timeout(240)
def test_sigkill_of_one_of_two_workers_loses_nothing(node, store, peer, tiny_model_dir, tmp_path):
    queue = peer.queue
    app = celery_app(node.url, [task_queue(queue)])
    # Both ready before the tasks go out, so that the kill comes while the victim holds some.
    victim = spawn_worker(peer.url, tiny_model_dir, "victim", *WORKER_ARGS, log_path=tmp_path / "victim.log")
    sent = []
    try:
        sent = [app.send_task(TASK, kwargs=job(KILL_TOKENS, first=10 + i), queue=queue) for i in range(20)]
        # Each holds what admission let it take (at most max_backlog waiting, plus running).
        wait_for(lambda: queue_counts(node.port, queue) <= 20 - 8, 60, "both workers to take tasks")
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        values = [r.get(timeout=180) for r in sent]
    finally:
        if victim.poll() is None:
            victim.kill()
        forget(store, [r.id for r in sent])
        app.close()
    assert peer.process.poll() is None
    assert all(v["status"] == "completed" and len(v["token_ids"]) == KILL_TOKENS for v in values)
    assert len({v["id"] for v in values}) == 20  # one result per task (first writer wins)
    redelivered = [v for v in values if v["attempts"] > 1]
    assert redelivered and all(v["worker"] == "peer" for v in redelivered)
    assert queue_counts(node.port, queue) == 0  # every delivery acked, none left behind
    # (A copy whose result the victim stored just before the kill, unacked, is acked by the peer
    # without running: one stored result per task either way.)


@pytest.mark.timeout(300)
def test_a_worker_rides_out_a_node_restart(node, store, peer):
    queue = peer.queue
    app = celery_app(node.url, [task_queue(queue)])
    logged_before = len(peer.log_path.read_text())
    sent = [app.send_task(TASK, kwargs=job(48, first=10 + i), queue=queue) for i in range(24)]
    try:
        wait_for(lambda: sum(1 for r in sent if r.ready()) >= 5, 60, "some tasks to complete")
        node.restart()
        # Sent after the restart: Celery reconnects its producer, the worker its source.
        sent += [app.send_task(TASK, kwargs=job(20, first=90 + i), queue=queue) for i in range(10)]
        values = [r.get(timeout=180) for r in sent]
        time.sleep(0.5)
    finally:
        forget(store, [r.id for r in sent])
        app.close()
    assert peer.process.poll() is None, "the worker rode the restart out"
    assert all(v["status"] == "completed" for v in values)
    assert len({v["id"] for v in values}) == 34
    assert queue_counts(node.port, queue) == 0
    log = peer.log_path.read_text()[logged_before:]
    assert "RabbitMQ" in log and "reconnecting" in log, log[-3000:]
