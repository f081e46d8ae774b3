"""LoRA adapters end to end through the doors: a worker process on the tiny random Llama (fp32)
serving two peft adapters (`--enable-lora --lora-modules a=...,b=...`), a gateway that names them
(`--lora-modules a,b`). The official openai SDK with `model="a"` gets adapter a's tokens; one
Batches API file with rows for both adapters and the base model gives each row the tokens that
adapter gives alone (peft's unmerged PeftModel, greedy: the reference)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from qworker.gateway.app import create_app
from qworker.gateway.settings import GatewaySettings
from qworker.testing.worker_kit import cleanup, kill_group, redis_base_url, spawn_worker, unique_url
from tests.gateway.conftest import API_KEY, serve_app
from tests.lora_support import ALL_LINEAR, make_adapter, peft_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 6
PROMPTS = [[1, 450, 3012, 17, 88], [1, 9001, 42, 7]]


@pytest.fixture(scope="module")
def lora_pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora-gateway")
    adapters = {
        "a": make_adapter(base, root / "a", seed=1, r=8, lora_alpha=16, target_modules=ALL_LINEAR),
        "b": make_adapter(base, root / "b", seed=2, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    }
    expected = {name: peft_greedy(base, path, PROMPTS, MAX_TOKENS) for name, path in adapters.items()}
    expected["base"] = peft_greedy(base, None, PROMPTS, MAX_TOKENS)
    assert expected["a"] != expected["base"] and expected["b"] != expected["base"]  # they change tokens

    url = unique_url(redis_base_url(), "lora-gw")
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    worker = spawn_worker(
        url,
        tiny_model_dir,
        "lora-w1",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        modules,
        log_path=root / "worker.log",
    )
    settings = GatewaySettings(
        model="tiny", tokenizer=str(tiny_model_dir), lora_modules="a,b", request_timeout_s=120
    )
    app = create_app(settings, queue=url, api_keys=frozenset({API_KEY}))
    try:
        with serve_app(app) as served:
            sdk = openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=120)
            yield sdk, expected, tiny_model_dir
    finally:
        kill_group(worker)
        cleanup(redis.Redis.from_url(redis_base_url()), url)


def test_the_sdk_names_an_adapter_as_its_model(lora_pool):
    sdk, expected, tokenizer_dir = lora_pool
    assert [m.id for m in sdk.models.list().data] == ["tiny", "a", "b"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for model, key in (("a", "a"), ("b", "b"), ("tiny", "base")):
        out = sdk.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert out.model == model
        assert out.choices[0].text == tokenizer.decode(expected[key][0], skip_special_tokens=True), model
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="c", prompt=PROMPTS[0], max_tokens=2)


def test_one_batch_file_compares_two_adapters_and_the_base(lora_pool):
    sdk, expected, tokenizer_dir = lora_pool
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [
        {
            "custom_id": f"{model}-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
        }
        for model in ("a", "b", "tiny")
        for i, prompt in enumerate(PROMPTS)
    ]
    content = "\n".join(json.dumps(row) for row in rows).encode()
    upload = sdk.files.create(file=(f"rows-{uuid.uuid4().hex[:6]}.jsonl", content), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.5)
        batch = sdk.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    lines = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    texts = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines}
    for model, key in (("a", "a"), ("b", "b"), ("tiny", "base")):
        for i in range(len(PROMPTS)):
            assert texts[f"{model}-{i}"] == tokenizer.decode(expected[key][i], skip_special_tokens=True), (
                model,
                i,
            )
