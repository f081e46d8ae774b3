"""End to end on SmolLM2: 50 jobs through Redis give exactly the text LLM.generate gives, and
streamed deltas join to the final text. One engine serves both sides."""

from __future__ import annotations

import threading

import pytest

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm import LLM
from qworker.engine.llm_engine import LLMEngine
from qworker.engine.sampling_params import SamplingParams
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 plus 2?",
    "Say hello in German.",
    "What do bees make?",
    "Which planet is closest to the sun?",
    "What is water made of?",
]


@pytest.fixture(scope="module")
def engine():
    # float32: the comparison is exact, so both sides use the same (deterministic) arithmetic.
    return LLMEngine(EngineConfig(model="smollm2", dtype="float32", device="cpu"))


def offline_llm(engine: LLMEngine) -> LLM:
    llm = LLM.__new__(LLM)
    llm.llm_engine = engine
    llm._counter = 0
    return llm


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fifty_jobs_match_llm_generate(engine, url):
    jobs = []
    for i in range(50):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (question {i})"
        jobs.append(
            {
                "messages": [{"role": "user", "content": question}],
                "params": {"max_tokens": 4 + i % 9, "temperature": 0.0},
                "metadata": {"index": i},
            }
        )
    client = Client(queue=url)
    job_ids = client.submit_many(jobs)
    worker = Worker(engine, open_source(url, consumer="e2e"), open_sink(url), WorkerSettings(name="e2e"))
    worker.run(burst=True)
    results = client.results(job_ids, timeout=10)

    prompts = [{"prompt_token_ids": engine.apply_chat_template(job["messages"])} for job in jobs]
    params = [SamplingParams(**job["params"]) for job in jobs]
    expected = offline_llm(engine).generate(prompts, params)
    for i, (result, reference) in enumerate(zip(results, expected, strict=True)):
        assert result.status is JobStatus.COMPLETED, result.error
        assert result.metadata == {"index": i}
        assert result.text == reference.outputs[0].text, i
        assert result.token_ids == reference.outputs[0].token_ids, i
        assert result.finish_reason == reference.outputs[0].finish_reason
        assert result.usage.prompt_tokens == len(prompts[i]["prompt_token_ids"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stream_joins_to_the_final_text(engine, url):
    worker = Worker(engine, open_source(url, consumer="e2e-stream"), open_sink(url), WorkerSettings(name="s"))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    client = Client(queue=url)
    job_id = client.submit(
        {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "params": {"max_tokens": 24}}
    )
    deltas = list(client.stream(job_id, timeout=120))
    result = client.result(job_id, timeout=10)
    worker.stop()
    thread.join(timeout=60)
    assert result.status is JobStatus.COMPLETED
    assert len(deltas) > 1 and "".join(deltas) == result.text
