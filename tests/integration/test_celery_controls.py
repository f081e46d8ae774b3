"""Celery's own controls on a qworker worker, through a real celery.Celery app and AsyncResult:
`expires` in the past (REVOKED, not run), `countdown`/`eta` (not started before its time while
other jobs run), `time_limit` (stopped at the limit: FAILURE with TimeLimitExceeded) and
`revoke()` of a running task (REVOKED within a second or two, the job stops).

Uses the suite's Redis server (tests/conftest.py), database 11, a unique queue name per test."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import redis as redis_lib

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.testing.worker_kit import redis_base_url
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.integration.conftest import wait_for

BROKER = redis_base_url(11)
TASK = "qworker.generate"
STEP_PAUSE_S = 0.02
# With the pause, a long job runs for several seconds on any machine.
LONG_TOKENS = 400


class SlowEngine:
    """The real engine, with a pause in every step, so that a long job is still running when the
    test acts on it."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine

    def step(self):
        time.sleep(STEP_PAUSE_S)
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture
def broker():
    r = redis_lib.Redis.from_url(BROKER)
    try:
        r.ping()
    except redis_lib.RedisError:
        pytest.fail("the suite's Redis server does not answer")
    return r


@pytest.fixture
def queue(broker):
    name = f"qwtest-controls-{uuid.uuid4().hex[:10]}"
    yield name
    for pattern in (f"{name}*", f"_kombu.binding.{name}*"):
        for key in broker.scan_iter(match=pattern, count=1000):
            broker.delete(key)


@pytest.fixture
def celery_app():
    from celery import Celery

    app = Celery("producer", broker=BROKER, backend=BROKER)
    app.conf.accept_content = ["json"]
    yield app
    app.close()


def job(max_tokens: int, first: int = 5) -> dict:
    return {"prompt_token_ids": [first, 6, 7], "params": {"max_tokens": max_tokens, "ignore_eos": True}}


@pytest.mark.timeout(180)
def test_expires_eta_time_limit_and_revoke(broker, queue, celery_app, tiny_model_dir):
    from celery.result import AsyncResult

    url = f"celery+{BROKER}?queue={queue}"
    engine = SlowEngine(
        LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=16
            )
        )
    )
    worker = Worker(engine, open_source(url, consumer="w"), open_sink(url), WorkerSettings(name="w"))
    sent: list[AsyncResult] = []

    def send(kwargs: dict, **options) -> AsyncResult:
        result = celery_app.send_task(TASK, kwargs=kwargs, queue=queue, **options)
        sent.append(result)
        return result

    expired = send(job(3), expires=datetime.now(UTC) - timedelta(seconds=30))
    eta_sent_at = time.time()
    delayed = send(job(3, first=8), countdown=3)
    quick = send(job(3, first=9))
    limited = send(job(LONG_TOKENS, first=10), time_limit=1)
    victim = send(job(LONG_TOKENS, first=11))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        # expires in the past: never run, REVOKED.
        wait_for(lambda: expired.state == "REVOKED", 20, "the expired task to be REVOKED")
        assert expired.backend.get_task_meta(expired.id)["qworker_result"]["error"]["type"] == "Expired"

        # revoke() while it runs: it stops, REVOKED.
        wait_for(lambda: broker.exists(f"qworker:deltas:{victim.id}"), 30, "the victim to start")
        revoked_at = time.monotonic()
        celery_app.control.revoke(victim.id)
        wait_for(lambda: victim.state == "REVOKED", 10, "the revoked task to be REVOKED")
        assert time.monotonic() - revoked_at < 2.0
        victim_result = victim.backend.get_task_meta(victim.id)["qworker_result"]
        assert (
            victim_result["status"] == "cancelled"
            and victim_result["usage"]["completion_tokens"] < LONG_TOKENS
        )

        # time_limit: stopped at the limit, TimeLimitExceeded.
        wait_for(lambda: limited.state == "FAILURE", 30, "the time-limited task to fail")
        assert type(limited.result).__name__ == "TimeLimitExceeded"
        timings = limited.backend.get_task_meta(limited.id)["qworker_result"]["timings"]
        assert 0.9 <= timings["finished_at"] - timings["started_at"] < 3.0

        # eta: the quick job sent after it finished first; the delayed one started at its eta.
        assert quick.get(timeout=30)["status"] == "completed"
        delayed_result = delayed.get(timeout=30)
        quick_result = quick.get(timeout=1)
        assert delayed_result["status"] == "completed"
        assert delayed_result["timings"]["started_at"] >= eta_sent_at + 3 - 0.05
        assert quick_result["timings"]["finished_at"] < delayed_result["timings"]["started_at"]
    finally:
        worker.stop()
        thread.join(timeout=60)
        for result in sent:
            broker.delete(f"celery-task-meta-{result.id}", f"qworker:deltas:{result.id}")
    assert not thread.is_alive()
    # Nothing left running in the engine: revoked and timed-out jobs freed their blocks.
    kv = worker.admission_stats()
    assert kv.num_free_blocks == kv.num_total_blocks
