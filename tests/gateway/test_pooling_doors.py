"""The pooling doors against a gateway on the in-memory queue with FakeEngine workers (no model):
the official openai SDK's embeddings.create (a string, a list, token ids, dimensions, both
encodings), its errors, /v1/score, /v1/rerank in vLLM's and Cohere's shapes, /pooling, and a
Batches API file of embeddings rows. The numbers are FakeEngine's (fake_pooled_vector): what is
checked here is that every door carries them, in order and in the right shape. The same doors
on a real model: tests/integration/test_pooling_doors_model.py."""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import time
import uuid

import httpx
import openai
import pytest
import redis

from qworker.backends.connections import open_sink, open_source
from qworker.engine.pooling_params import PoolingParams
from qworker.gateway.app import create_app
from qworker.gateway.settings import GatewaySettings
from qworker.jobs.pooling_job import MAX_POOLING_INPUTS
from qworker.openai.format import BatchOutputLine
from qworker.testing.fake_engine import FakeEngine, fake_pooled_vector
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.gateway.conftest import serve_app
from tests.gateway.test_hostile_http import write_byte_tokenizer

pytestmark = pytest.mark.timeout(60)

KEY = "sk-pooling-" + uuid.uuid4().hex
MAX_MODEL_LEN = 256


def expected(tokens: list[int] | bytes, **params) -> list[float]:
    return fake_pooled_vector(list(tokens), PoolingParams(**params))


def start_pool(engine: FakeEngine, url: str):
    worker = Worker(
        engine,
        open_source(url, consumer="fake-1"),
        open_sink(url),
        WorkerSettings(name="fake-1", poll_interval_s=0.02, cancel_check_interval_s=0.05),
    )
    thread = threading.Thread(target=worker.run, name="fake-pooling-worker", daemon=True)
    thread.start()
    return url, worker, thread


def gateway_settings(tokenizer_dir, files_dir) -> GatewaySettings:
    return GatewaySettings(
        model="fake",
        tokenizer=str(tokenizer_dir),
        request_timeout_s=20,
        max_model_len=MAX_MODEL_LEN,
        files_url=str(files_dir),
    )


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """(an embedding pool's gateway, a generation-only pool's gateway): one gateway per pool."""
    tokenizer_dir = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(tokenizer_dir)
    # The embedding pool on the tests' Redis (the Batches API keeps its state there), the
    # generation-only one in memory.
    redis_url = unique_url(redis_base_url(), "pooling")
    pools = [
        start_pool(FakeEngine(max_model_len=MAX_MODEL_LEN), redis_url),
        start_pool(
            FakeEngine(max_model_len=MAX_MODEL_LEN, supported_tasks=("generate",)),
            f"memory://pooling-{uuid.uuid4().hex[:8]}",
        ),
    ]
    served = []
    try:
        for index, (url, _, _) in enumerate(pools):
            app = create_app(
                gateway_settings(tokenizer_dir, tmp_path_factory.mktemp(f"files-{index}")),
                queue=url,
                api_keys=frozenset({KEY}),
            )
            served.append(serve_app(app))
        yield [s.__enter__() for s in served]
    finally:
        for s in served:
            s.__exit__(None, None, None)
        for _, worker, thread in pools:
            worker.stop()
            thread.join(timeout=10)
        cleanup(redis.Redis.from_url(redis_base_url()), redis_url)


@pytest.fixture(scope="module")
def sdk(gateways):
    return openai.OpenAI(base_url=gateways[0].base_url, api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(gateways):
    with httpx.Client(base_url=gateways[0].url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


def test_sdk_embeds_a_string_in_base64_by_default_and_decodes_it(sdk):
    # The SDK asks for base64 when no encoding_format is given and decodes it with numpy.
    response = sdk.embeddings.create(model="fake", input="hello")
    assert response.object == "list" and response.model == "fake"
    assert len(response.data) == 1 and response.data[0].index == 0
    assert response.data[0].embedding == pytest.approx(expected(b"hello"), abs=1e-6)
    assert response.usage.prompt_tokens == response.usage.total_tokens == 5


def test_sdk_list_token_ids_dimensions_and_float_encoding(sdk):
    texts = ["a longer second text", "b", "mid"]
    floats = sdk.embeddings.create(model="fake", input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    for item, text in zip(floats.data, texts, strict=True):
        assert item.embedding == pytest.approx(expected(text.encode()), abs=1e-6)
    ids = sdk.embeddings.create(model="fake", input=[7, 8, 9])
    assert ids.data[0].embedding == pytest.approx(expected([7, 8, 9]), abs=1e-6)
    lists = sdk.embeddings.create(model="fake", input=[[1, 2], [3, 4, 5]], encoding_format="float")
    assert lists.data[1].embedding == pytest.approx(expected([3, 4, 5]), abs=1e-6)
    cut = sdk.embeddings.create(model="fake", input="hello", dimensions=3)
    assert len(cut.data[0].embedding) == 3
    assert cut.data[0].embedding == pytest.approx(expected(b"hello", dimensions=3), abs=1e-6)


def test_base64_is_little_endian_float32(http):
    body = http.post("/v1/embeddings", json={"input": "hi", "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(expected(b"hi"), abs=1e-6)


@pytest.mark.parametrize(
    ("input", "param", "words"),
    [
        ("", "input", "input is empty"),
        ([], "input", "input is empty"),
        (["ok", ""], "input", "input[1] is empty"),
        ("x" * (MAX_MODEL_LEN + 1), "input", f"context is {MAX_MODEL_LEN} tokens"),
        ([1] * (MAX_MODEL_LEN + 5), "input", f"context is {MAX_MODEL_LEN} tokens"),
        (["a"] * (MAX_POOLING_INPUTS + 1), "input", f"the limit is {MAX_POOLING_INPUTS}"),
    ],
)
def test_sdk_errors_are_400s_naming_the_field(sdk, input, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.embeddings.create(model="fake", input=input)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    assert words in error["message"], error


def test_a_generation_model_asked_to_embed_is_a_400_saying_so(gateways):
    client = openai.OpenAI(base_url=gateways[1].base_url, api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="fake", input="hello")
    message = caught.value.body["message"]
    assert "UnsupportedTaskError" in message and "cannot embed" in message and "generate" in message
    # The same pool still generates.
    assert client.completions.create(model="fake", prompt="hi", max_tokens=3).choices[0].text == "abc"


def test_an_unknown_model_and_a_dimensions_above_the_hidden_size(sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="other", input="hello")
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.embeddings.create(model="fake", input="hello", dimensions=64)
    assert "hidden size" in caught.value.body["message"]


def test_score_pairs_one_query_with_many_and_pairs_in_order(http):
    docs = ["first doc", "second", "third one"]
    body = http.post("/v1/score", json={"model": "fake", "text_1": "query", "text_2": docs}).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    want = [expected([*b"query", 0, *d.encode()], task="score")[0] for d in docs]
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
    pairs = http.post("/score", json={"text_1": ["q1", "q2", "q1"], "text_2": ["a", "b", "c"]}).json()
    want = [
        expected([*q.encode(), 0, *d.encode()], task="score")[0]
        for q, d in (("q1", "a"), ("q2", "b"), ("q1", "c"))
    ]
    assert [d["score"] for d in pairs["data"]] == pytest.approx(want, abs=1e-6)
    bad = http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"


def test_rerank_orders_by_score_in_both_shapes(http):
    docs = ["alpha", "beta gamma", "delta", "epsilon zeta eta"]
    scores = [expected([*b"query", 0, *d.encode()], task="score")[0] for d in docs]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    vllm = http.post("/v1/rerank", json={"model": "fake", "query": "query", "documents": docs}).json()
    assert [r["index"] for r in vllm["results"]] == order
    assert [r["relevance_score"] for r in vllm["results"]] == pytest.approx(
        [scores[i] for i in order], abs=1e-6
    )
    assert [r["document"]["text"] for r in vllm["results"]] == [docs[i] for i in order]
    assert vllm["usage"]["total_tokens"] > 0
    # Cohere's shape: documents as {"text"} objects, top_n, no documents returned.
    cohere = http.post(
        "/v2/rerank",
        json={
            "query": "query",
            "documents": [{"text": d} for d in docs],
            "top_n": 2,
            "return_documents": False,
        },
    ).json()
    assert [r["index"] for r in cohere["results"]] == order[:2]
    assert all("document" not in r for r in cohere["results"])
    jina = http.post(
        "/rerank", json={"model": "fake", "query": "query", "documents": docs, "top_n": 3}
    ).json()
    assert [r["index"] for r in jina["results"]] == order[:3]


def test_pooling_route_embeds_and_classifies(http):
    embed = http.post("/pooling", json={"model": "fake", "input": ["ab", "c"]}).json()
    assert embed["object"] == "list" and [d["object"] for d in embed["data"]] == ["pooling"] * 2
    assert embed["data"][1]["data"] == pytest.approx(expected(b"c"), abs=1e-6)
    classify = http.post("/pooling", json={"input": "ab", "task": "classify", "use_activation": False}).json()
    assert classify["data"][0]["data"] == pytest.approx(
        expected(b"ab", task="classify", use_activation=False), abs=1e-6
    )
    bad = http.post("/pooling", json={"input": "ab", "task": "generate"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "task"


def test_a_batch_of_embeddings_rows_through_the_batches_api(sdk):
    texts = [f"text number {i} " + "x" * (i % 23) for i in range(200)]
    rows = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "fake", "input": t},
        }
        for i, t in enumerate(texts)
    ]
    rows.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": []}})
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 45
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 200 and batch.request_counts.failed == 1, batch.request_counts
    lines = [
        BatchOutputLine.model_validate_json(line)
        for line in sdk.files.content(batch.output_file_id).text.splitlines()
    ]
    if batch.error_file_id:
        lines += [
            BatchOutputLine.model_validate_json(x)
            for x in sdk.files.content(batch.error_file_id).text.splitlines()
        ]
    by_id = {line.custom_id: line for line in lines}
    assert len(lines) == len(by_id) == 201, "one line per custom_id"
    for i, text in enumerate(texts):
        body = by_id[f"r{i}"].response.body.model_dump()
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        assert body["data"][0]["embedding"] == pytest.approx(expected(text.encode()), abs=1e-6)
        assert body["usage"]["prompt_tokens"] == len(text.encode())
    assert by_id["bad"].error is not None and "input is empty" in by_id["bad"].error.message
