"""SQS + S3 end to end: 20 SmolLM2 jobs through SQS with results in S3 (every pairing of the 5
questions with the 4 output lengths, half with an affinity key) give LLM.generate's greedy text;
a worker killed with SIGKILL loses nothing and every job has one result object."""

from __future__ import annotations

import signal

import pytest

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm import LLM
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import spawn_worker
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.integration.conftest import wait_for

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 plus 2?",
    "Say hello in German.",
    "What do bees make?",
]


def offline_llm(engine: LLMEngine) -> LLM:
    llm = LLM.__new__(LLM)
    llm.llm_engine = engine
    llm._counter = 0
    return llm


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sqs_jobs_with_s3_results_match_llm_generate(sqs_s3):
    """20 jobs: i % 5 picks the question and i % 4 the length, so each pairing runs once."""
    env = sqs_s3(VisibilityTimeout="30")
    # float32: exact comparison, both sides with the same arithmetic. Short outputs keep it cheap.
    engine = LLMEngine(EngineConfig(model="smollm2", dtype="float32", device="cpu"))
    jobs = [
        {
            "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
            "params": {"max_tokens": 2 + i % 4, "temperature": 0.0},
            "metadata": {"index": i},
            # SQS has one lane: the key is accepted and has no effect on where or how a job runs.
            **({"affinity": f"task-{i % 3}"} if i % 2 else {}),
        }
        for i in range(20)
    ]
    client = Client(queue=env.queue_url, results=env.results_url)
    job_ids = client.submit_many(jobs)
    worker = Worker(
        engine,
        open_source(env.queue_url, consumer="e2e"),
        open_sink(env.results_url),
        WorkerSettings(name="e2e"),
    )
    worker.run(burst=True)
    results = client.results(job_ids, timeout=10)
    prompts = [{"prompt_token_ids": engine.apply_chat_template(job["messages"])} for job in jobs]
    expected = offline_llm(engine).generate(prompts, [SamplingParams(**job["params"]) for job in jobs])
    for i, (result, reference) in enumerate(zip(results, expected, strict=True)):
        assert result.status is JobStatus.COMPLETED, result.error
        assert result.metadata == {"index": i}
        assert result.text == reference.outputs[0].text, i
        assert result.token_ids == reference.outputs[0].token_ids, i
    assert sorted(env.result_keys()) == sorted(f"results/{j}.json" for j in job_ids)
    assert client.queue_depth() == 0
    client.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_on_sqs_loses_nothing_one_object_per_job(sqs_s3, tiny_model_dir, tmp_path):
    env = sqs_s3(VisibilityTimeout="3")
    client = Client(queue=env.queue_url, results=env.results_url)
    num_jobs = 12
    # The first two jobs are short, so that the victim has finished some (the kill's condition)
    # after a few steps and not after a long job's 100: the victim's run before the kill is
    # start-up plus those steps. The long ones are still held, mid-generation, when it is killed.
    job_ids = client.submit_many(
        [
            {
                "prompt_token_ids": [10 + i, 11, 12],
                "params": {"max_tokens": 8 if i < 2 else 100 + i % 7, "ignore_eos": True},
            }
            for i in range(num_jobs)
        ]
    )
    common = ("--results", env.results_url, "--num-kv-blocks", "256", "--max-backlog", "4")
    victim = spawn_worker(env.queue_url, tiny_model_dir, "victim", *common, log_path=tmp_path / "victim.log")
    peer = None
    sqs = env.sqs()

    def in_flight() -> int:
        attrs = sqs.get_queue_attributes(
            QueueUrl=env.sqs_queue_url, AttributeNames=["ApproximateNumberOfMessagesNotVisible"]
        )["Attributes"]
        return int(attrs["ApproximateNumberOfMessagesNotVisible"])

    try:
        # Kill the victim mid-run: it holds jobs, and has finished some.
        wait_for(lambda: len(env.result_keys()) >= 2 and in_flight() >= 4, 90, "the victim to hold jobs")
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        peer = spawn_worker(env.queue_url, tiny_model_dir, "peer", *common, log_path=tmp_path / "peer.log")
        results = client.results(job_ids, timeout=200)
    finally:
        for process in (victim, peer):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        if peer is not None:
            assert peer.wait(timeout=60) == 0
    assert all(r.status is JobStatus.COMPLETED for r in results)
    assert sorted(env.result_keys()) == sorted(f"results/{j}.json" for j in job_ids)
    reclaimed = [r for r in results if r.attempts > 1]
    assert reclaimed and all(r.worker == "peer" for r in reclaimed)
    assert {r.worker for r in results} == {"victim", "peer"}
    assert client.queue_depth() == 0
    client.close()
