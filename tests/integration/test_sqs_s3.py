"""SQS source and S3 result store against moto's server mode (leases, dead letters, large payloads through
S3, the S3 and split-sink rules), in-process on a tiny random model with the SmolLM2 tokenizer."""

from __future__ import annotations

import json
import threading
import time

import pytest

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobResult, JobStatus
from qworker.testing.worker_kit import redis_base_url
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.integration.conftest import wait_for


@pytest.fixture(scope="module")
def tiny_engine_args(tiny_model_dir):
    return dict(model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=16)


class SlowEngine:
    """The engine, with a pause in every step: a job that must outlive a lease does, on any machine."""

    def __init__(self, engine: LLMEngine, step_pause_s: float) -> None:
        self._engine = engine
        self._pause = step_pause_s

    def step(self):
        time.sleep(self._pause)
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def make_worker(env, engine, name, lease_timeout_s=None, results=None, stream=None, **settings) -> Worker:
    source = open_source(env.queue_url, consumer=name, lease_timeout_s=lease_timeout_s)
    sink = open_sink(results or env.results_url, stream)
    return Worker(engine, source, sink, WorkerSettings(name=name, **settings))


def short_job(i: int, **extra):
    return {"prompt_token_ids": [5 + i % 50, 6, 7], "params": {"max_tokens": 3, "ignore_eos": True}, **extra}


def receive_count_bump(env, times: int) -> None:
    """Receive every message `times` times without deleting it (visibility 0): a stand-in for
    workers that died holding it."""
    sqs = env.sqs()
    for _ in range(times):
        reply = sqs.receive_message(
            QueueUrl=env.sqs_queue_url, MaxNumberOfMessages=10, VisibilityTimeout=0, WaitTimeSeconds=0
        )
        assert reply.get("Messages"), "expected the message to be visible"


@pytest.mark.timeout(120)
def test_s3_store_keeps_one_object_per_job_and_skips_done_jobs(sqs_s3, tiny_engine_args):
    env = sqs_s3()
    sink = open_sink(env.results_url)
    first = JobResult(id="dup", status=JobStatus.COMPLETED, text="first")
    assert sink.write_result(first) is True
    assert sink.write_result(JobResult(id="dup", status=JobStatus.COMPLETED, text="second")) is False
    assert sink.get_result("dup").text == "first"
    assert env.result_keys() == ["results/dup.json"]
    assert sink.has_result("dup") and not sink.has_result("other") and sink.get_result("other") is None
    # A redelivered job whose result exists is acked without running.
    with Client(queue=env.queue_url, results=env.results_url) as client:
        client.submit({"id": "dup", "prompt_token_ids": [1, 2], "params": {"max_tokens": 2}})
        worker = make_worker(env, LLMEngine(EngineConfig(**tiny_engine_args)), "w")
        stats = worker.run(burst=True)
        assert stats.num_skipped_done == 1 and stats.num_completed == 0
        assert client.result("dup", timeout=1).text == "first"
        assert client.queue_depth() == 0
    # Without conditional puts: HEAD then PUT, same answer for a sequential duplicate.
    plain = open_sink(env.results_url + "&conditional_put=false")
    assert plain.write_result(JobResult(id="dup", status=JobStatus.FAILED)) is False
    assert plain.write_result(JobResult(id="new", status=JobStatus.FAILED)) is True


@pytest.mark.timeout(120)
def test_visibility_heartbeat_prevents_a_second_delivery(sqs_s3, tiny_engine_args):
    env = sqs_s3(VisibilityTimeout="2")
    engine = LLMEngine(EngineConfig(**tiny_engine_args))
    client = Client(queue=env.queue_url, results=env.results_url)
    # ~100 steps x 50 ms: the job runs for 5 s or more, past two visibility timeouts.
    job_id = client.submit({"prompt_token_ids": [5, 6, 7], "params": {"max_tokens": 100, "ignore_eos": True}})
    runner = make_worker(env, SlowEngine(engine, 0.05), "runner")
    thread = threading.Thread(target=runner.run, daemon=True)
    started = time.monotonic()
    thread.start()
    wait_for(lambda: runner.num_jobs_held == 1, 30, "the runner to take the job")
    # A peer polls the same queue the whole time; it must never receive the job.
    peer = make_worker(env, LLMEngine(EngineConfig(**tiny_engine_args)), "peer")
    peer_thread = threading.Thread(target=peer.run, daemon=True)
    peer_thread.start()
    result = client.result(job_id, timeout=60)
    elapsed = time.monotonic() - started
    runner.stop()
    peer.stop()
    thread.join(30)
    peer_thread.join(30)
    assert elapsed > 4.0, f"the job must outlive the 2 s visibility timeout twice (took {elapsed:.1f}s)"
    assert result.status is JobStatus.COMPLETED and result.worker == "runner" and result.attempts == 1
    assert len(result.token_ids) == 100
    assert peer.stats.num_completed == 0 and peer.stats.num_skipped_done == 0
    assert runner.stats.num_leases_lost == 0
    assert client.queue_depth() == 0
    client.close()


@pytest.mark.timeout(120)
def test_poison_goes_to_the_dlq_with_its_reason_and_valid_jobs_complete(sqs_s3, tiny_engine_args):
    env = sqs_s3(VisibilityTimeout="30")
    sqs = env.sqs()
    client = Client(queue=env.queue_url, results=env.results_url)
    # A job that (as if it killed its workers) was received 3 times already.
    poison_id = client.submit(short_job(0, id="poison"))
    receive_count_bump(env, 3)
    # Bytes that are not a job and carry no id: dead-lettered at once, nothing to store.
    sqs.send_message(QueueUrl=env.sqs_queue_url, MessageBody="\x00 not json")
    valid_ids = client.submit_many([short_job(i) for i in range(12)])
    worker = make_worker(env, LLMEngine(EngineConfig(**tiny_engine_args)), "w", max_attempts=3)
    stats = worker.run(burst=True)
    results = client.results(valid_ids, timeout=10)
    assert all(r.status is JobStatus.COMPLETED for r in results)
    poison = client.result(poison_id, timeout=1)
    assert poison.status is JobStatus.FAILED and poison.error.type == "DeadLettered"
    assert "delivered 4 times; max_attempts is 3" in poison.error.message
    assert stats.num_dead_lettered == 2
    dlq_url = sqs.get_queue_url(QueueName=f"{env.queue}-dlq")["QueueUrl"]
    dead = sqs.receive_message(
        QueueUrl=dlq_url, MaxNumberOfMessages=10, MessageAttributeNames=["All"], WaitTimeSeconds=0
    )["Messages"]
    reasons = {m["MessageAttributes"].get("qworker_id", {}).get("StringValue"): m for m in dead}
    assert set(reasons) == {"poison", None}
    assert "max_attempts is 3" in reasons["poison"]["MessageAttributes"]["reason"]["StringValue"]
    assert json.loads(reasons["poison"]["Body"])["id"] == "poison"
    assert "not a JSON object" in reasons[None]["MessageAttributes"]["reason"]["StringValue"]
    assert client.queue_depth() == 0
    client.close()


@pytest.mark.timeout(120)
def test_redrive_policy_fifo_group_kept_and_worker_dead_letters_first(sqs_s3, tiny_engine_args):
    """With a RedrivePolicy (maxReceiveCount 3) the worker dead-letters after 2 deliveries, with a
    reason, into the policy's queue; on FIFO queues the MessageGroupId is kept."""
    dlq = sqs_s3(fifo=True)
    dlq_arn = dlq.sqs().get_queue_attributes(QueueUrl=dlq.sqs_queue_url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]
    env = sqs_s3(
        fifo=True,
        VisibilityTimeout="30",
        RedrivePolicy=json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "3"}),
    )
    client = Client(queue=env.queue_url, results=env.results_url)
    client.submit(short_job(0, id="poison"), group_id="tenant-a")
    receive_count_bump(env, 2)
    valid_ids = client.submit_many([short_job(i) for i in range(5)], group_id="tenant-b")
    worker = make_worker(env, LLMEngine(EngineConfig(**tiny_engine_args)), "w", max_attempts=5)
    assert worker.max_attempts == 2
    worker.run(burst=True)
    assert all(r.status is JobStatus.COMPLETED for r in client.results(valid_ids, timeout=10))
    assert client.result("poison", timeout=1).error.type == "DeadLettered"
    dead = dlq.sqs().receive_message(
        QueueUrl=dlq.sqs_queue_url,
        MessageAttributeNames=["All"],
        MessageSystemAttributeNames=["MessageGroupId"],
    )["Messages"]
    assert len(dead) == 1
    assert dead[0]["Attributes"]["MessageGroupId"] == "tenant-a"
    assert "max_attempts is 2" in dead[0]["MessageAttributes"]["reason"]["StringValue"]
    client.close()


@pytest.mark.timeout(120)
def test_large_jobs_go_through_s3_pointers(sqs_s3, tiny_engine_args):
    env = sqs_s3()
    client = Client(queue=env.queue_url, results=env.results_url)
    padding = "x" * (1100 * 1024)  # over SQS's 1 MiB message limit
    fits_id = client.submit(
        {"prompt": "Hello there", "params": {"max_tokens": 4}, "metadata": {"padding": padding}}
    )
    too_long_id = client.submit(
        {"prompt_token_ids": [100 + i % 1000 for i in range(300_000)], "params": {"max_tokens": 4}}
    )
    payloads = [k for k in env.result_keys() if "/_payloads/" in k]
    assert len(payloads) == 2, "both jobs must travel as S3 pointers"
    worker = make_worker(env, LLMEngine(EngineConfig(**tiny_engine_args)), "w")
    worker.run(burst=True)
    fits = client.result(fits_id, timeout=5)
    assert fits.status is JobStatus.COMPLETED and fits.usage.completion_tokens > 0
    assert fits.metadata == {"padding": padding}
    too_long = client.result(too_long_id, timeout=5)
    assert too_long.status is JobStatus.FAILED
    assert too_long.error.type == "PromptTooLongError" and "300000" in too_long.error.message
    assert client.queue_depth() == 0
    # Payload objects go with their messages; the dead letter of the too-long job keeps its
    # pointer (a worker with a longer context can take a replay).
    assert [k for k in env.result_keys() if "/_payloads/" in k] == [f"results/_payloads/{too_long_id}.json"]
    client.close()


@pytest.mark.timeout(120)
def test_missing_payload_object_is_dead_lettered_with_a_failed_result(sqs_s3, tiny_engine_args):
    env = sqs_s3()
    env.sqs().send_message(
        QueueUrl=env.sqs_queue_url,
        MessageBody=json.dumps({"s3_payload": f"s3://{env.bucket}/nowhere.json"}),
        MessageAttributes={"qworker_id": {"DataType": "String", "StringValue": "lost"}},
    )
    worker = make_worker(env, LLMEngine(EngineConfig(**tiny_engine_args)), "w")
    assert worker.run(burst=True).num_dead_lettered == 1
    result = open_sink(env.results_url).get_result("lost")
    assert result.status is JobStatus.FAILED and result.error.type == "Rejected"
    assert "nowhere.json" in result.error.message


@pytest.mark.timeout(120)
def test_stream_to_redis_final_to_s3(sqs_s3, tiny_engine_args):
    env = sqs_s3()
    prefix = f"qwtest:split:{env.queue}"
    stream_url = f"{redis_base_url()}?prefix={prefix}"
    client = Client(queue=env.queue_url, results=env.results_url, stream_results=stream_url)
    job_id = client.submit({"prompt": "Once upon a time", "params": {"max_tokens": 12, "ignore_eos": True}})
    worker = make_worker(env, LLMEngine(EngineConfig(**tiny_engine_args)), "w", stream=stream_url)
    thread = threading.Thread(target=worker.run, kwargs={"burst": True}, daemon=True)
    thread.start()
    deltas = list(client.stream(job_id, timeout=30))
    thread.join(30)
    result = client.result(job_id, timeout=5)
    assert result.status is JobStatus.COMPLETED and "".join(deltas) == result.text and len(deltas) > 1
    assert env.result_keys() == [f"results/{job_id}.json"]
    import redis

    r = redis.Redis.from_url(redis_base_url())
    assert not r.exists(f"{prefix}:result:{job_id}"), "the final result lives in S3 only"
    for key in r.scan_iter(match=f"{prefix}*"):
        r.delete(key)
    client.close()
