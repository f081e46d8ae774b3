"""Worker lifecycle against a real Redis server, in-process, on a tiny random model with the
SmolLM2 tokenizer: streaming, poison input, deadlines, TTL, cancel, redelivery, dead letters,
admission. The same paths run without a model or Redis in tests/unit/test_worker_loop.py."""

from __future__ import annotations

import threading
import time

import pytest

from qworker.backends.connections import open_sink, open_source
from qworker.backends.redis import keys as constants
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobResult, JobStatus
from qworker.worker.loop import Worker, run_beside
from qworker.worker.settings import WorkerSettings
from tests.integration.conftest import raw_redis, url_params


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir


def make_worker(url, tiny_dir, name="w1", lease_timeout_s=30.0, max_backlog=8, **engine_args) -> Worker:
    args = dict(model=str(tiny_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=16)
    args.update(engine_args)
    engine = LLMEngine(EngineConfig(**args))
    settings = WorkerSettings(name=name, max_backlog=max_backlog, max_attempts=3)
    return Worker(
        engine, open_source(url, consumer=name, lease_timeout_s=lease_timeout_s), open_sink(url), settings
    )


def long_job(max_tokens=800, **extra):
    return {
        "prompt_token_ids": [5, 6, 7, 8],
        "params": {"max_tokens": max_tokens, "ignore_eos": True},
        **extra,
    }


def start(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def stop(worker: Worker, thread: threading.Thread) -> None:
    worker.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()


def assert_nothing_pending(url):
    params = url_params(url)
    info = raw_redis(url).xpending(params["stream"], params["group"])
    assert info["pending"] == 0, info


@pytest.mark.timeout(120)
def test_stream_yields_deltas_before_the_job_finishes(url, tiny_dir):
    worker = make_worker(url, tiny_dir)
    thread = start(worker)
    client = Client(queue=url)
    job_id = client.submit({"prompt": "Tell me a story", "params": {"max_tokens": 200, "ignore_eos": True}})
    deltas = []
    result_seen_at_first_delta = None
    for text in client.stream(job_id, timeout=60):
        if not deltas:
            result_seen_at_first_delta = client.sink.get_result(job_id)
        deltas.append(text)
    result = client.result(job_id, timeout=10)
    stop(worker, thread)
    assert result.status is JobStatus.COMPLETED and result.usage.completion_tokens == 200
    assert result_seen_at_first_delta is None, "the first delta must arrive before the result"
    assert len(deltas) > 1
    assert "".join(deltas) == result.text and result.text
    assert result.timings.enqueued_at <= result.timings.started_at <= result.timings.first_token_at
    assert result.timings.first_token_at <= result.timings.finished_at
    assert_nothing_pending(url)


@pytest.mark.timeout(120)
def test_run_beside_serves_on_this_thread_and_returns_the_task_value(url, tiny_dir):
    worker = make_worker(url, tiny_dir)
    client = Client(queue=url)
    job = {"prompt": "hello", "params": {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}}

    def submit_and_wait() -> list[JobResult]:
        return client.results(client.submit_many([job, job]), timeout=60)

    results = run_beside(worker, submit_and_wait)
    assert [r.status for r in results] == [JobStatus.COMPLETED] * 2
    assert {r.worker for r in results} == {worker.name}
    client.close()


@pytest.mark.timeout(120)
def test_run_beside_stops_the_worker_and_reraises_a_failing_task(url, tiny_dir):
    worker = make_worker(url, tiny_dir)

    def fail() -> None:
        raise KeyError("from the task")

    with pytest.raises(KeyError, match="from the task"):
        run_beside(worker, fail)
    assert worker._stop.is_set()


@pytest.mark.timeout(120)
def test_poison_input_fails_cleanly_and_the_queue_keeps_moving(url, tiny_dir):
    params = url_params(url)
    r = raw_redis(url)
    client = Client(queue=url)
    stream = params["stream"]
    good_before = client.submit({"prompt": "hello", "params": {"max_tokens": 4}})
    poison = {
        "not-json": b"\xff\xfe{not json",
        "wrong-shape": b'["a", "list"]',
        "unknown-param": b'{"prompt": "hi", "params": {"max_tokens": 4, "temprature": 0.5}}',
        "too-long": ('{"prompt_token_ids": [' + ",".join(["7"] * 2000) + "]}").encode(),
        "max-tokens-huge": b'{"prompt": "hi", "params": {"max_tokens": 1000000000}}',
        "empty-messages": b'{"messages": []}',
        "ten-mb": ('{"prompt": "' + "a" * (10 * 2**20) + '"}').encode(),
        "bad-token-id": b'{"prompt_token_ids": [1, 99999999]}',
    }
    for job_id, body in poison.items():
        r.xadd(stream, {constants.FIELD_JOB_ID: job_id, constants.FIELD_BODY: body})
    # No id anywhere: nothing to store a result under, so it goes to the dead-letter stream.
    r.xadd(stream, {constants.FIELD_BODY: b"\x00\x01 garbage"})
    good_after = client.submit({"messages": [{"role": "user", "content": "hi"}], "params": {"max_tokens": 4}})

    worker = make_worker(url, tiny_dir)
    worker.run(burst=True)

    expected = {
        "not-json": "not valid JSON",
        "wrong-shape": "must be a JSON object",
        "unknown-param": "params.temprature: unknown field",
        "too-long": "prompt has 2000 tokens; the model's context is 1024",
        "max-tokens-huge": "max_tokens must be at most",
        "empty-messages": "messages is empty",
        "ten-mb": "MiB; the limit is",
        "bad-token-id": "outside the vocabulary",
    }
    for job_id, fragment in expected.items():
        result = client.result(job_id, timeout=1)
        assert result.status is JobStatus.FAILED, job_id
        assert fragment in result.error.message, (job_id, result.error)
    for job_id in (good_before, good_after):
        assert client.result(job_id, timeout=1).status is JobStatus.COMPLETED
    # Two dead letters: the entry with no id (nothing to store a result under), and the too-long
    # prompt, which keeps its failed result but is dead-lettered so that a worker with a longer
    # context can take a replay.
    dead = r.xrange(constants.dead_letter_stream(stream))
    reasons = sorted(entry[1][b"reason"] for entry in dead)
    assert len(dead) == 2, reasons
    assert any(b"cannot read a job id" in reason for reason in reasons), reasons
    assert any(b"2000 tokens" in reason for reason in reasons), reasons
    assert worker.stats.num_dead_lettered == 2
    assert_nothing_pending(url)
    assert r.xlen(stream) == 0


@pytest.mark.timeout(120)
def test_deadline_running_and_queued(url, tiny_dir):
    client = Client(queue=url)
    # One sequence at a time: the second job waits behind the first and times out before it starts.
    running_id = client.submit(long_job(max_tokens=1000, timeout_s=1.0))
    queued_id = client.submit(long_job(max_tokens=8, timeout_s=0.3))
    worker = make_worker(url, tiny_dir, max_num_seqs=1)
    worker.run(burst=True)
    running = client.result(running_id, timeout=1)
    assert running.status is JobStatus.TIMEOUT and running.error.type == "Timeout"
    assert 0 < running.usage.completion_tokens < 1000
    assert len(running.token_ids) == running.usage.completion_tokens and running.text
    queued = client.result(queued_id, timeout=1)
    assert queued.status is JobStatus.TIMEOUT and queued.usage.completion_tokens == 0
    assert worker.engine.kv_stats().num_free_blocks == worker.engine.kv_stats().num_total_blocks
    assert_nothing_pending(url)


@pytest.mark.timeout(120)
def test_ttl_expired_in_queue_is_failed_without_running(url, tiny_dir):
    client = Client(queue=url)
    expired_id = client.submit(long_job(max_tokens=8, ttl_s=0.2))
    time.sleep(0.4)
    fresh_id = client.submit(long_job(max_tokens=8, ttl_s=60))
    worker = make_worker(url, tiny_dir)
    worker.run(burst=True)
    expired = client.result(expired_id, timeout=1)
    assert expired.status is JobStatus.FAILED and expired.error.type == "Expired"
    assert expired.usage.completion_tokens == 0 and "ttl_s is 0.2" in expired.error.message
    assert client.result(fresh_id, timeout=1).status is JobStatus.COMPLETED
    assert_nothing_pending(url)


@pytest.mark.timeout(120)
def test_cancel_queued_and_running(url, tiny_dir):
    client = Client(queue=url)
    queued_id = client.submit(long_job(max_tokens=8))
    client.cancel(queued_id)
    worker = make_worker(url, tiny_dir)
    worker.run(burst=True)
    queued = client.result(queued_id, timeout=1)
    assert queued.status is JobStatus.CANCELLED and queued.usage.completion_tokens == 0

    thread = start(worker)
    running_id = client.submit(long_job(max_tokens=1000))
    for _ in client.stream(running_id, timeout=30):
        client.cancel(running_id)
        break
    running = client.result(running_id, timeout=30)
    assert running.status is JobStatus.CANCELLED
    assert 0 < running.usage.completion_tokens < 1000 and running.finish_reason == "cancelled"
    kv = worker.engine.kv_stats()
    assert kv.num_free_blocks == kv.num_total_blocks, "a cancelled job frees its blocks"
    stop(worker, thread)
    assert_nothing_pending(url)


@pytest.mark.timeout(120)
def test_redelivered_job_with_a_result_is_acked_without_running(url, tiny_dir):
    client = Client(queue=url)
    job_id = client.submit(long_job(max_tokens=8))
    stored = JobResult(id=job_id, status=JobStatus.COMPLETED, text="from before", worker="earlier")
    assert client.sink.write_result(stored)
    assert not client.sink.write_result(JobResult(id=job_id, status=JobStatus.FAILED)), "one result per id"
    worker = make_worker(url, tiny_dir)
    worker.run(burst=True)
    assert worker.stats.num_skipped_done == 1 and worker.stats.num_completed == 0
    assert client.result(job_id, timeout=1).text == "from before"
    assert_nothing_pending(url)


@pytest.mark.timeout(120)
def test_too_many_deliveries_go_to_the_dead_letter_stream(url, tiny_dir):
    params = url_params(url)
    r = raw_redis(url)
    client = Client(queue=url)
    job_id = client.submit(long_job(max_tokens=8))
    # A consumer that takes the job and dies, three times over.
    r.xreadgroup(params["group"], "dead-consumer", {params["stream"]: ">"}, count=1)
    entry_id = r.xpending_range(params["stream"], params["group"], "-", "+", 1)[0]["message_id"]
    for _ in range(2):
        r.xclaim(params["stream"], params["group"], "dead-consumer", 0, [entry_id])
    time.sleep(0.3)
    worker = make_worker(url, tiny_dir, lease_timeout_s=0.2)
    worker.run(burst=True)
    result = client.result(job_id, timeout=1)
    assert result.status is JobStatus.FAILED and result.error.type == "DeadLettered"
    assert result.attempts == 4 and "max_attempts is 3" in result.error.message
    dead = r.xrange(constants.dead_letter_stream(params["stream"]))
    assert len(dead) == 1 and dead[0][1][b"id"].decode() == job_id
    assert_nothing_pending(url)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_admission_bounds_what_a_worker_holds_and_peers_share(url, tiny_dir):
    params = url_params(url)
    r = raw_redis(url)
    client = Client(queue=url)
    # Each job: 60 prompt tokens (4 blocks of 16 with its first token), 60 generated: 8 blocks at the end.
    num_jobs, num_kv_blocks, max_backlog = 40, 32, 2
    job_ids = client.submit_many(
        [
            {"prompt_token_ids": [3 + i % 50] * 60, "params": {"max_tokens": 60, "ignore_eos": True}}
            for i in range(40)
        ]
    )
    # Documented bound (admission.py): held <= running + max_backlog, and at most
    # num_kv_blocks // prompt_blocks jobs can have their prompts in the cache at once.
    bound = num_kv_blocks // 4 + max_backlog
    first = make_worker(url, tiny_dir, name="first", num_kv_blocks=num_kv_blocks, max_backlog=max_backlog)
    second = make_worker(url, tiny_dir, name="second", num_kv_blocks=num_kv_blocks, max_backlog=max_backlog)
    # The most entries each consumer held, read right after each of its leases: only a lease adds
    # to what a consumer holds, so this sees every peak (a sampler on a timer can miss one).
    max_pending = {"first": 0, "second": 0}

    def record_peaks(worker: Worker) -> None:
        lease = worker.source.lease

        def lease_and_record(*args, **kwargs):
            leases = lease(*args, **kwargs)
            for consumer in r.xpending(params["stream"], params["group"])["consumers"]:
                name = consumer["name"].decode()
                max_pending[name] = max(max_pending[name], int(consumer["pending"]))
            return leases

        worker.source.lease = lease_and_record  # type: ignore[method-assign]

    record_peaks(first)
    record_peaks(second)
    first_thread = start(first)
    deadline = time.monotonic() + 120
    while first.stats.num_completed < 4:
        assert time.monotonic() < deadline, "the first worker completed 4 jobs"
        time.sleep(0.01)
    second_thread = start(second)
    results = client.results(job_ids, timeout=240)
    stop(first, first_thread)
    stop(second, second_thread)
    assert all(res.status is JobStatus.COMPLETED for res in results)
    assert max_pending["first"] <= bound and max_pending["second"] <= bound, (max_pending, bound)
    by_second = sum(res.worker == "second" for res in results)
    remaining_at_start = num_jobs - 4 - bound
    assert by_second >= remaining_at_start // 4, (by_second, remaining_at_start)
    assert_nothing_pending(url)
