"""The gateway on SQS (moto's server mode) with results in S3: chat, streaming through
--stream-results (Redis), streaming without a delta store (one chunk at the end), and an error
that comes back from the worker through the S3 result. The worker runs in this process on a tiny
random Llama with the SmolLM2 tokenizer."""

from __future__ import annotations

import threading
import uuid

import openai
import pytest
import redis

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.gateway.app import create_app
from qworker.gateway.settings import GatewaySettings
from qworker.jobs.client import Client
from qworker.testing.worker_kit import redis_base_url
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.gateway.conftest import serve_app
from tests.gateway.test_openai_sdk import job_id_of
from tests.integration.conftest import SqsS3, moto_server, tiny_model_dir  # noqa: F401 - fixtures

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def fresh_queue_and_bucket(moto) -> SqsS3:
    """As tests/integration's sqs_s3 fixture, once for this module."""
    tag = uuid.uuid4().hex[:10]
    queue_url = moto.client("sqs").create_queue(QueueName=f"qw-gw-{tag}")["QueueUrl"]
    moto.client("s3").create_bucket(Bucket=f"qw-gw-{tag}")
    return SqsS3(
        moto,
        f"qw-gw-{tag}",
        f"qw-gw-{tag}",
        f"sqs://qw-gw-{tag}?{moto.query}",
        f"s3://qw-gw-{tag}/results?{moto.query}",
        queue_url,
    )


@pytest.fixture(scope="module")
def sqs_pool(moto_server, tiny_model_dir):  # noqa: F811 - the imported fixture
    env = fresh_queue_and_bucket(moto_server)
    stream_url = f"{redis_base_url()}?prefix=qwtest:gwsqs:{env.queue}"
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=16
        )
    )
    worker = Worker(
        engine,
        open_source(env.queue_url, consumer="gw-sqs"),
        open_sink(env.results_url, stream_url),
        WorkerSettings(name="gw-sqs", poll_interval_s=0.1),
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    yield env, stream_url
    worker.stop()
    thread.join(timeout=30)
    r = redis.Redis.from_url(redis_base_url())
    for key in r.scan_iter(match=f"qwtest:gwsqs:{env.queue}*"):
        r.delete(key)


@pytest.fixture(scope="module")
def gateways(sqs_pool, tiny_model_dir):  # noqa: F811
    env, stream_url = sqs_pool
    settings = GatewaySettings(model="smollm2", tokenizer=str(tiny_model_dir), request_timeout_s=60)
    streaming = create_app(settings, queue=env.queue_url, results=env.results_url, stream_results=stream_url)
    final_only = create_app(settings, queue=env.queue_url, results=env.results_url)
    with serve_app(streaming) as a, serve_app(final_only) as b:
        yield (
            openai.OpenAI(base_url=a.base_url, api_key="unused", max_retries=0, timeout=60),
            openai.OpenAI(base_url=b.base_url, api_key="unused", max_retries=0, timeout=60),
        )


def stored(env, response_id: str):
    with Client(queue=env.queue_url, results=env.results_url) as client:
        return client.result(job_id_of(response_id), timeout=10)


@pytest.mark.timeout(120)
def test_chat_on_sqs_with_results_in_s3(gateways, sqs_pool):
    env, _ = sqs_pool
    sdk, _ = gateways
    response = sdk.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0)
    assert response.choices[0].message.content == stored(env, response.id).text
    assert f"results/{job_id_of(response.id)}.json" in env.result_keys()


@pytest.mark.timeout(120)
def test_streaming_through_stream_results_and_without_a_delta_store(gateways, sqs_pool):
    env, _ = sqs_pool
    live, final_only = gateways
    for sdk, is_live in ((live, True), (final_only, False)):
        chunks = list(
            sdk.chat.completions.create(
                model="smollm2",
                messages=MESSAGES,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == stored(env, chunks[0].id).text
        # Live: token by token. From S3 alone: the whole text in one chunk when the job ends.
        assert len(pieces) > 1 if is_live else len(pieces) == 1


@pytest.mark.timeout(60)
def test_a_worker_side_error_comes_back_through_s3(gateways):
    sdk, _ = gateways
    # Valid for the gateway, refused by the worker's engine (outside the vocabulary): a failed
    # result in S3, answered as 400.
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=4, extra_body={"stop_token_ids": [10**9]}
        )
    assert "vocabulary" in bad.value.message
