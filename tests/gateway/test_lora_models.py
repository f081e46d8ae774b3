"""LoRA adapters as model names on the gateway (--lora-modules): /v1/models lists each with the
base model as its parent, as vLLM does; a request naming one becomes a job with that adapter; an
unknown name is a 404 naming the served ones. In-process (the real app over httpx's ASGI
transport, on an in-memory queue with no worker)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from qworker.gateway.app import create_app
from qworker.gateway.mapping import prepare
from qworker.gateway.settings import GatewaySettings
from qworker.openai.rows import Endpoint

pytestmark = pytest.mark.timeout(30)

KEY = "sk-lora-" + uuid.uuid4().hex
SETTINGS = GatewaySettings(
    model="base-model",
    tokenizer="/nonexistent-tokenizer",
    max_model_len=256,
    request_timeout_s=2,
    lora_modules="customer-a=/adapters/a,customer-b",
)


def get(path: str) -> httpx.Response:
    app = create_app(SETTINGS, queue=f"memory://lora-{uuid.uuid4().hex[:8]}", api_keys=frozenset({KEY}))

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get(path, headers={"Authorization": f"Bearer {KEY}"})

    return asyncio.run(run())


def test_models_lists_the_base_and_each_adapter_with_its_parent():
    cards = {card["id"]: card for card in get("/v1/models").json()["data"]}
    assert list(cards) == ["base-model", "customer-a", "customer-b"]
    assert cards["base-model"]["parent"] is None
    assert cards["customer-a"]["parent"] == cards["customer-b"]["parent"] == "base-model"
    assert get("/v1/models/customer-b").json()["parent"] == "base-model"
    missing = get("/v1/models/customer-z")
    assert missing.status_code == 404 and "'customer-a'" in missing.json()["error"]["message"]


def chat(model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return body if model is None else {**body, "model": model}


def test_a_request_naming_an_adapter_runs_with_it():
    assert prepare(chat("customer-a"), Endpoint.CHAT, SETTINGS, None).jobs[0].lora == "customer-a"
    assert prepare(chat("base-model"), Endpoint.CHAT, SETTINGS, None).jobs[0].lora is None
    assert prepare(chat(None), Endpoint.CHAT, SETTINGS, None).jobs[0].lora is None
    completion = {"prompt": ["one", "two"], "model": "customer-b", "max_tokens": 2}
    assert [j.lora for j in prepare(completion, Endpoint.COMPLETIONS, SETTINGS, None).jobs] == [
        "customer-b"
    ] * 2


def test_a_bad_lora_modules_setting_names_the_entry():
    with pytest.raises(ValueError, match="must match"):
        GatewaySettings(lora_modules="../x=/p")
