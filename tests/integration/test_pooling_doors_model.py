"""The pooling doors on a real model: a `qworker worker` process (tiny random Llama with the
SmolLM2 tokenizer, fp32, last-token pooling) on the tests' Redis behind an in-process gateway.
The openai SDK's embeddings (a string, a list, token ids, dimensions, both encodings) and a
200-row embeddings batch file (every length from 1 to 40 words five times, so that the steps
pack inputs of every length up to three blocks) through `qworker batch` (local) and the Batches API
give the vectors `LLM.embed` gives in this process, within 1e-5 (fp32; the steps pack other
inputs)."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid

import openai
import pytest
import redis
import torch

from qworker.batch.command import BatchRun, run_batch
from qworker.config import EngineConfig
from qworker.engine.llm import LLM
from qworker.gateway.app import create_app
from qworker.gateway.settings import GatewaySettings
from qworker.openai.batches.progress import ProgressMode
from qworker.openai.format import BatchOutputLine
from qworker.testing.worker_kit import (
    cleanup,
    kill_group,
    redis_base_url,
    spawn_worker,
    unique_url,
)
from tests.gateway.conftest import serve_app

pytestmark = pytest.mark.timeout(180)

KEY = "sk-pool-model-" + uuid.uuid4().hex
TOLERANCE = 1e-5
# 7 and 40 are coprime: each 40 rows take every word count from 1 to 40 once, in a mixed order.
# 200 rows: the batch-file size.
NUM_TEXTS = 200
TEXTS = [f"document {i}: " + " ".join(["word"] * (1 + (i * 7) % 40)) for i in range(NUM_TEXTS)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    """The session's tiny model (write_tiny_model_dir's defaults): built once per test process."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def pool(model_dir, tmp_path_factory, request):
    url = unique_url(redis_base_url(), "pool-model")
    folder = tmp_path_factory.mktemp("pool-model")
    started: dict = {}

    def start() -> None:
        try:
            # 256 KV blocks: every input here fits many times over, and they build in 0.4 s where
            # the 16384 sized from memory take 1.5 s.
            started["process"] = spawn_worker(
                url, model_dir, "pool-w1", "--num-kv-blocks", "256", log_path=folder / "w1.log"
            )
        except Exception as exc:
            started["error"] = exc

    # The worker starts (imports torch, loads the model) while this process computes the references.
    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    request.getfixturevalue("references")
    thread.join(timeout=150)
    if "error" in started:
        raise started["error"]
    process = started["process"]
    settings = GatewaySettings(
        model="tiny", tokenizer=str(model_dir), request_timeout_s=120, files_url=str(folder / "files")
    )
    try:
        with serve_app(create_app(settings, queue=url, api_keys=frozenset({KEY}))) as served:
            yield served
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except Exception:
            kill_group(process)
        cleanup(redis.Redis.from_url(redis_base_url()), url)


@pytest.fixture(scope="module")
def llm(model_dir):
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(model=str(model_dir), dtype="float32", device="cpu")
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def references(llm):
    """text -> LLM.embed's vector."""
    return {text: out.outputs.embedding for text, out in zip(TEXTS, llm.embed(TEXTS), strict=True)}


@pytest.fixture(scope="module")
def sdk(pool):
    return openai.OpenAI(base_url=pool.base_url, api_key=KEY, max_retries=0, timeout=120)


def test_sdk_embeddings_equal_llm_embed(sdk, llm, references):
    text = TEXTS[3]
    # No encoding_format: the SDK asks for base64 and decodes it.
    one = sdk.embeddings.create(model="tiny", input=text)
    assert one.data[0].embedding == pytest.approx(references[text], abs=TOLERANCE)
    assert one.usage.prompt_tokens == len(llm.get_tokenizer().encode(text))
    several = sdk.embeddings.create(model="tiny", input=TEXTS[:5], encoding_format="float")
    assert [d.index for d in several.data] == list(range(5))
    for item, text in zip(several.data, TEXTS[:5], strict=True):
        assert item.embedding == pytest.approx(references[text], abs=TOLERANCE)
    ids = [1, 42, 4242, 17]
    by_ids = sdk.embeddings.create(model="tiny", input=ids)
    assert by_ids.data[0].embedding == pytest.approx(llm.embed([ids])[0].outputs.embedding, abs=TOLERANCE)
    cut = sdk.embeddings.create(model="tiny", input=text, dimensions=8)
    want = llm.embed([text], pooling_params=llm_params(dimensions=8))[0].outputs.embedding
    assert len(cut.data[0].embedding) == 8
    assert cut.data[0].embedding == pytest.approx(want, abs=TOLERANCE)


def llm_params(**fields):
    from qworker.engine.pooling_params import PoolingParams

    return PoolingParams(task="embed", **fields)


def test_an_input_over_the_context_is_a_400_naming_the_limit(sdk):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.embeddings.create(model="tiny", input=[5] * 5000)
    assert caught.value.body["param"] == "input" and "context is" in caught.value.body["message"]


def rows() -> list[dict]:
    return [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "tiny", "input": t},
        }
        for i, t in enumerate(TEXTS)
    ]


def check_lines(lines: list[BatchOutputLine], references: dict[str, list[float]]) -> None:
    by_id = {line.custom_id: line for line in lines}
    assert len(lines) == len(by_id) == len(TEXTS), "one line per custom_id"
    for i, text in enumerate(TEXTS):
        line = by_id[f"e{i}"]
        assert line.error is None and line.response is not None, line
        body = line.response.body.model_dump()
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        assert body["data"][0]["embedding"] == pytest.approx(references[text], abs=TOLERANCE)


def test_a_batch_file_of_embeddings_through_qworker_batch_locally(llm, references, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    out = tmp_path / "out.jsonl"
    run = BatchRun(
        input=str(source),
        output=str(out),
        served_model_names=["tiny"],
        progress=ProgressMode.NONE,
        work_dir=tmp_path / "work",
    )
    summary = run_batch(run, EngineConfig(model="unused"), engine=llm.llm_engine)
    assert summary.num_run == len(TEXTS) and summary.num_failed == 0, summary
    check_lines([BatchOutputLine.model_validate_json(x) for x in out.read_text().splitlines()], references)


def test_a_batch_file_of_embeddings_through_the_batches_api(sdk, references):
    data = "".join(json.dumps(r) + "\n" for r in rows()).encode()
    file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 150
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    assert batch.status == "completed" and batch.request_counts.completed == len(TEXTS), batch
    text = sdk.files.content(batch.output_file_id).text
    check_lines([BatchOutputLine.model_validate_json(x) for x in text.splitlines()], references)
