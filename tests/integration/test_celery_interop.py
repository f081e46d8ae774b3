"""Celery interop: a real celery.Celery app is the producer and reads the
results; qworker consumes the Celery protocol v2 messages from the Redis broker with kombu.

Uses the suite's Redis server (tests/conftest.py), database 11, a unique queue name per test."""

from __future__ import annotations

import json
import signal
import threading
import uuid

import pytest
import redis as redis_lib

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import redis_base_url, spawn_worker
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.integration.conftest import wait_for

BROKER = redis_base_url(11)


@pytest.fixture(scope="module")
def broker():
    r = redis_lib.Redis.from_url(BROKER)
    try:
        r.ping()
    except redis_lib.RedisError:
        pytest.fail("the suite's Redis server does not answer")
    return r


@pytest.fixture
def queue(broker):
    name = f"qwtest-celery-{uuid.uuid4().hex[:10]}"
    yield name
    for pattern in (f"{name}*", f"_kombu.binding.{name}*", "qworker:deltas:*"):
        for key in broker.scan_iter(match=pattern, count=1000):
            broker.delete(key)


@pytest.fixture
def celery_app():
    from celery import Celery

    app = Celery("producer", broker=BROKER, backend=BROKER)
    # The producer may send pickle (the security test does); qworker must refuse it anyway.
    app.conf.accept_content = ["json", "pickle"]
    app.conf.result_accept_content = ["json"]
    yield app
    app.close()


def queue_url(queue: str, **params: object) -> str:
    extra = "".join(f"&{k}={v}" for k, v in params.items())
    return f"celery+{BROKER}?queue={queue}{extra}"


def make_worker(engine_args, url: str, name: str = "w") -> Worker:
    engine = LLMEngine(EngineConfig(**engine_args))
    return Worker(engine, open_source(url, consumer=name), open_sink(url), WorkerSettings(name=name))


@pytest.fixture(scope="module")
def engine_args(tiny_model_dir):
    return dict(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=16)


def forget(broker, task_ids) -> None:
    for task_id in task_ids:
        broker.delete(f"celery-task-meta-{task_id}")


@pytest.mark.timeout(180)
def test_send_task_results_and_invalid_kwargs(broker, queue, celery_app, engine_args):
    jobs = [
        {"prompt_token_ids": [5 + i, 6, 7], "params": {"max_tokens": 2 + i % 4, "ignore_eos": True}}
        for i in range(30)
    ]
    sent = [celery_app.send_task("qworker.generate", kwargs=job, queue=queue) for job in jobs]
    chat = celery_app.send_task(
        "qworker.generate",
        # A Celery queue has one lane: the affinity key is accepted and has no effect.
        kwargs={
            "messages": [{"role": "user", "content": "Hi"}],
            "params": {"max_tokens": 3},
            "affinity": "t1",
        },
        queue=queue,
    )
    bad_params = celery_app.send_task(
        "qworker.generate", kwargs={"prompt": "x", "params": {"max_tokens": 0}}, queue=queue
    )
    unknown_field = celery_app.send_task("qworker.generate", kwargs={"prompt": "x", "bogus": 1}, queue=queue)
    # Penalties and biases travel in the task's params as in any job (issue 43).
    biased = celery_app.send_task(
        "qworker.generate",
        kwargs={
            "prompt_token_ids": [5, 6],
            "params": {"max_tokens": 3, "logit_bias": {"77": 100}, "presence_penalty": 1.0},
        },
        queue=queue,
    )
    bad_penalty = celery_app.send_task(
        "qworker.generate", kwargs={"prompt": "x", "params": {"frequency_penalty": 3}}, queue=queue
    )
    worker = make_worker(engine_args, queue_url(queue))
    thread = threading.Thread(target=worker.run, kwargs={"burst": True}, daemon=True)
    thread.start()
    try:
        for i, async_result in enumerate(sent):
            value = async_result.get(timeout=120)
            assert isinstance(value, dict) and value["id"] == async_result.id
            assert (
                value["status"] == "completed" and len(value["token_ids"]) == jobs[i]["params"]["max_tokens"]
            )
        assert chat.get(timeout=60)["status"] == "completed"
        with pytest.raises(Exception) as bad:
            bad_params.get(timeout=60)
        assert type(bad.value).__name__ == "ValidationError" and "max_tokens" in str(bad.value)
        assert bad_params.state == "FAILURE"
        with pytest.raises(Exception) as unknown:
            unknown_field.get(timeout=60)
        assert "bogus: unknown field" in str(unknown.value)
        assert biased.get(timeout=60)["token_ids"] == [77, 77, 77]
        with pytest.raises(Exception) as penalty:
            bad_penalty.get(timeout=60)
        assert "frequency_penalty must be in [-2, 2]" in str(penalty.value)
    finally:
        thread.join(60)
    # Everything acked: the queue and the unacked index are empty.
    assert broker.llen(queue) == 0 and broker.hlen(f"{queue}.unacked") == 0
    # The client reads the same results through qworker's own API.
    with Client(queue=queue_url(queue)) as client:
        assert client.result(sent[0].id, timeout=1).status is JobStatus.COMPLETED
        assert client.result(bad_params.id, timeout=1).error.type == "ValidationError"
    forget(broker, [r.id for r in (*sent, chat, bad_params, unknown_field, biased, bad_penalty)])


class PlantsAFile:
    """Unpickling this creates a file: proof that a payload was deserialized."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.timeout(120)
def test_pickle_is_refused_and_never_unpickled(broker, queue, celery_app, engine_args, tmp_path):
    marker = tmp_path / "pwned"
    evil = celery_app.send_task(
        "qworker.generate", kwargs={"prompt": PlantsAFile(str(marker))}, queue=queue, serializer="pickle"
    )
    fine = celery_app.send_task("qworker.generate", kwargs={"prompt_token_ids": [5, 6]}, queue=queue)
    assert not marker.exists()
    worker = make_worker(engine_args, queue_url(queue))
    stats = worker.run(burst=True)
    assert not marker.exists(), "the pickle payload was deserialized"
    assert stats.num_dead_lettered == 1
    assert fine.get(timeout=30)["status"] == "completed"
    with pytest.raises(Exception) as refused:
        evil.get(timeout=30)
    assert type(refused.value).__name__ == "Rejected"
    assert "application/x-python-serialize" in str(refused.value) and "not accepted" in str(refused.value)
    dead = [json.loads(x) for x in broker.lrange(f"{queue}.dead", 0, -1)]
    assert len(dead) == 1 and dead[0]["task_id"] == evil.id
    assert "not accepted" in dead[0]["reason"]
    assert dead[0]["envelope"]["content-type"] == "application/x-python-serialize"
    assert not marker.exists()
    assert broker.llen(queue) == 0 and broker.hlen(f"{queue}.unacked") == 0
    forget(broker, [evil.id, fine.id])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_worker_tasks_are_redelivered_and_completed(
    broker, queue, celery_app, tiny_model_dir, tmp_path
):
    url = queue_url(queue, lease_timeout_s=2)
    sent = [
        celery_app.send_task(
            "qworker.generate",
            kwargs={"prompt_token_ids": [10 + i, 11], "params": {"max_tokens": 100, "ignore_eos": True}},
            queue=queue,
        )
        for i in range(12)
    ]
    common = ("--num-kv-blocks", "256", "--max-backlog", "4")
    victim = spawn_worker(url, tiny_model_dir, "victim", *common, log_path=tmp_path / "victim.log")
    peer = None
    try:
        wait_for(lambda: broker.hlen(f"{queue}.unacked") >= 4, 60, "the victim to hold tasks")
        held = broker.hlen(f"{queue}.unacked")
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        peer = spawn_worker(url, tiny_model_dir, "peer", *common, log_path=tmp_path / "peer.log")
        values = [r.get(timeout=180) for r in sent]
    finally:
        for process in (victim, peer):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        if peer is not None:
            assert peer.wait(timeout=60) == 0
    assert held > 0
    assert all(v["status"] == "completed" and len(v["token_ids"]) == 100 for v in values)
    redelivered = [v for v in values if v["attempts"] > 1]
    assert redelivered and all(v["worker"] == "peer" for v in redelivered)
    assert broker.llen(queue) == 0 and broker.hlen(f"{queue}.unacked") == 0
    forget(broker, [r.id for r in sent])


@pytest.mark.timeout(120)
def test_qworker_client_on_a_celery_queue_streams_and_celery_reads_it(broker, queue, celery_app, engine_args):
    from celery.result import AsyncResult

    with Client(queue=queue_url(queue)) as client:
        job_id = client.submit(
            {"prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 6, "ignore_eos": True}}
        )
        worker = make_worker(engine_args, queue_url(queue))
        thread = threading.Thread(target=worker.run, kwargs={"burst": True}, daemon=True)
        thread.start()
        deltas = list(client.stream(job_id, timeout=60))
        thread.join(60)
        result = client.result(job_id, timeout=5)
    assert result.status is JobStatus.COMPLETED and len(result.token_ids) == 6
    assert "".join(deltas) == result.text
    assert AsyncResult(job_id, app=celery_app).get(timeout=5)["token_ids"] == result.token_ids
    forget(broker, [job_id])
