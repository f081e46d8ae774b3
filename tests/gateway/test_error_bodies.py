"""Every error body the gateway writes, case by case: status, OpenAI type, code (never null) and
param (the field at fault, null when no one field is), in-process (the real app over httpx's ASGI
transport, on an in-memory queue with no worker: none of these requests reaches one), and where a
client branches on them, through the official openai SDK's exception attributes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from qworker.gateway.app import create_app
from qworker.gateway.errors import CODE_OF_STATUS, GatewayError
from qworker.gateway.settings import GatewaySettings

KEY = "sk-errors-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = "application/json"
MAX_BODY_BYTES = 4 * 2**20
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = b'"messages": [{"role": "user", "content": "hi"}]'
IRE = "invalid_request_error"


@pytest.fixture(scope="module")
def app() -> Any:
    settings = GatewaySettings(
        model="fake",
        tokenizer="/nonexistent-tokenizer",  # none: token counts are estimates, no load per test
        max_model_len=256,
        request_timeout_s=2,
        max_body_bytes=MAX_BODY_BYTES,
    )
    return create_app(settings, queue=f"memory://errors-{uuid.uuid4().hex[:8]}", api_keys=frozenset({KEY}))


def call(app: Any, make: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await make(client)

    return asyncio.run(run())


def post(app: Any, path: str, content: bytes, content_type: str | None = JSON) -> httpx.Response:
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    return call(app, lambda client: client.post(path, content=content, headers=headers))


def error_of(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["code"] is not None, error
    return error


def big_completion(num_bytes: int) -> bytes:
    return b'{"model": "fake", "prompt": "' + b"a" * num_bytes + b'"}'


def big_chat(num_bytes: int) -> bytes:
    return b'{"model": "fake", "messages": [{"role": "user", "content": "' + b"a" * num_bytes + b'"}]}'


# (id, path, body, content type, status, type, code, param, words the message must hold)
CASES: list[tuple[str, str, bytes, str | None, int, str, str, str | None, tuple[str, ...]]] = [
    (
        "invalid-json",
        COMPLETIONS,
        b'{"model": "fake", "prompt": [',
        JSON,
        400,
        IRE,
        "invalid_json",
        None,
        ("not valid JSON", "line 1, column 30"),
    ),
    (
        "invalid-json-chat",
        CHAT,
        b'{"model": "fake",\n "messages": [',
        JSON,
        400,
        IRE,
        "invalid_json",
        None,
        ("line 2, column 15",),
    ),
    (
        "invalid-utf8",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "\xff\xfe"}',
        JSON,
        400,
        IRE,
        "invalid_json",
        None,
        ("UTF-8", "line 1, column 30"),
    ),
    (
        "array-body",
        COMPLETIONS,
        b"[1, 2, 3]",
        JSON,
        400,
        IRE,
        "invalid_body",
        None,
        ("JSON object", "an array"),
    ),
    ("string-body", CHAT, b'"hi"', JSON, 400, IRE, "invalid_body", None, ("a string",)),
    ("empty-body", CHAT, b"", JSON, 400, IRE, "invalid_body", None, ("no body",)),
    (
        "text-plain",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "hi"}',
        "text/plain",
        400,
        IRE,
        "unsupported_content_type",
        None,
        ("text/plain", "application/json"),
    ),
    (
        "form",
        CHAT,
        b"model=fake&prompt=hi",
        "application/x-www-form-urlencoded",
        400,
        IRE,
        "unsupported_content_type",
        None,
        ("application/x-www-form-urlencoded",),
    ),
    (
        "no-content-type",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "hi"}',
        None,
        400,
        IRE,
        "unsupported_content_type",
        None,
        ("no Content-Type",),
    ),
    (
        "temperature",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "hi", "temperature": -1}',
        JSON,
        400,
        IRE,
        IRE,
        "temperature",
        ("temperature",),
    ),
    (
        "temperature-chat",
        CHAT,
        b'{"model": "fake", ' + HI + b', "temperature": -1}',
        JSON,
        400,
        IRE,
        IRE,
        "temperature",
        ("temperature",),
    ),
    ("top-p", CHAT, b'{"model": "fake", ' + HI + b', "top_p": 2}', JSON, 400, IRE, IRE, "top_p", ("top_p",)),
    *[
        (
            f"{field}-out-of-range",
            CHAT,
            b'{"model": "fake", ' + HI + b', "' + field.encode() + b'": ' + value + b"}",
            JSON,
            400,
            IRE,
            IRE,
            field,
            (field,),
        )
        for field, value in (
            ("presence_penalty", b"2.5"),
            ("frequency_penalty", b"-3"),
            ("repetition_penalty", b"0"),
            ("logit_bias", b'{"12": 100.5}'),
            ("allowed_token_ids", b"[]"),
            ("bad_words", b'[""]'),
            ("truncate_prompt_tokens", b"0"),
        )
    ],
    (
        "affinity",
        CHAT,
        b'{"model": "fake", ' + HI + b', "affinity": 5}',
        JSON,
        400,
        IRE,
        IRE,
        "affinity",
        ("string",),
    ),
    (
        "max-tokens",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "hi", "max_tokens": -5}',
        JSON,
        400,
        IRE,
        IRE,
        "max_tokens",
        ("max_tokens",),
    ),
    (
        "max-completion-tokens",
        CHAT,
        b'{"model": "fake", ' + HI + b', "max_completion_tokens": 0}',
        JSON,
        400,
        IRE,
        IRE,
        "max_completion_tokens",
        ("max_completion_tokens",),
    ),
    ("n", COMPLETIONS, b'{"model": "fake", "prompt": "hi", "n": 0}', JSON, 400, IRE, IRE, "n", ("n must",)),
    (
        "min-tokens",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "hi", "min_tokens": 9, "max_tokens": 2}',
        JSON,
        400,
        IRE,
        IRE,
        "min_tokens",
        ("min_tokens",),
    ),
    (
        "wrong-type",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "hi", "temperature": "hot"}',
        JSON,
        400,
        IRE,
        IRE,
        "temperature",
        ("temperature",),
    ),
    (
        "union-type",
        COMPLETIONS,
        b'{"model": "fake", "prompt": 5}',
        JSON,
        400,
        IRE,
        IRE,
        "prompt",
        ("prompt",),
    ),
    (
        "nested-field",
        CHAT,
        b'{"model": "fake", "messages": [{"content": "hi"}]}',
        JSON,
        400,
        IRE,
        IRE,
        "messages[0].role",
        ("messages[0].role is required",),
    ),
    (
        "missing-prompt",
        COMPLETIONS,
        b'{"model": "fake"}',
        JSON,
        400,
        IRE,
        IRE,
        "prompt",
        ("prompt is required",),
    ),
    (
        "missing-messages",
        CHAT,
        b'{"model": "fake"}',
        JSON,
        400,
        IRE,
        IRE,
        "messages",
        ("messages is required",),
    ),
    (
        "unknown-field",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "hi", "bogus": 1}',
        JSON,
        400,
        IRE,
        IRE,
        "bogus",
        ("bogus",),
    ),
    (
        "unsupported",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "hi", "best_of": 3}',
        JSON,
        400,
        IRE,
        "unsupported_parameter",
        "best_of",
        ("best_of",),
    ),
    (
        "unknown-model",
        COMPLETIONS,
        b'{"model": "nope", "prompt": "hi"}',
        JSON,
        404,
        "not_found_error",
        "model_not_found",
        "model",
        ("'nope'",),
    ),
    (
        "unknown-model-chat",
        CHAT,
        b'{"model": "nope", ' + HI + b"}",
        JSON,
        404,
        "not_found_error",
        "model_not_found",
        "model",
        ("'nope'",),
    ),
    (
        "context",
        COMPLETIONS,
        b'{"model": "fake", "prompt": "' + b"a " * 2000 + b'"}',
        JSON,
        400,
        IRE,
        "context_length_exceeded",
        "prompt",
        ("context",),
    ),
    # Under --max-body-bytes, over what one job may be: 413 on both endpoints (it was 400 on
    # completions, where Job.prompt's 1M-character bound failed first, and 413 on chat).
    (
        "3mb-completions",
        COMPLETIONS,
        big_completion(3_000_000),
        JSON,
        413,
        IRE,
        "request_too_large",
        "prompt",
        ("at most",),
    ),
    ("3mb-chat", CHAT, big_chat(3_000_000), JSON, 413, IRE, "request_too_large", "messages", ("at most",)),
    (
        "5mb-completions",
        COMPLETIONS,
        big_completion(5_000_000),
        JSON,
        413,
        IRE,
        "request_too_large",
        None,
        (str(MAX_BODY_BYTES),),
    ),
    (
        "5mb-chat",
        CHAT,
        big_chat(5_000_000),
        JSON,
        413,
        IRE,
        "request_too_large",
        None,
        (str(MAX_BODY_BYTES),),
    ),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("path", "body", "content_type", "status", "error_type", "code", "param", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_error_body(
    app: Any,
    path: str,
    body: bytes,
    content_type: str | None,
    status: int,
    error_type: str,
    code: str,
    param: str | None,
    words: tuple[str, ...],
) -> None:
    response = post(app, path, body, content_type)
    assert response.status_code == status, response.text[:500]
    error = error_of(response)
    assert (error["type"], error["code"], error["param"]) == (error_type, code, param), error
    for word in words:
        assert word in error["message"], error


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_chunked_body_over_the_limit_gets_the_same_413(app: Any, path: str) -> None:
    body = big_completion(5_000_000) if path == COMPLETIONS else big_chat(5_000_000)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    response = call(app, lambda c: c.post(path, content=chunks(), headers={**AUTH, "Content-Type": JSON}))
    assert response.status_code == 413, response.text[:500]
    error = error_of(response)
    assert (error["code"], error["param"]) == ("request_too_large", None), error
    declared = post(app, path, body)
    assert declared.status_code == 413 and error_of(declared) == error


@pytest.mark.timeout(30)
def test_routes_methods_and_keys_have_codes(app: Any) -> None:
    unknown = call(app, lambda c: c.get("/v1/nothing", headers=AUTH))
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "not_found"
    wrong_method = call(app, lambda c: c.get(COMPLETIONS, headers=AUTH))
    assert wrong_method.status_code == 405 and error_of(wrong_method)["code"] == "method_not_allowed"
    no_key = call(app, lambda c: c.get("/v1/models"))
    assert no_key.status_code == 401 and error_of(no_key)["code"] == "missing_api_key"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("status", sorted({*CODE_OF_STATUS, 400, 402, 418, 500, 502, 507}))
def test_an_error_raised_without_a_code_gets_its_status_code(status: int) -> None:
    error = GatewayError(status, "x").body()["error"]
    assert error["code"] and error["type"], error
    assert GatewayError(status, "x", code="mine").body()["error"]["code"] == "mine"


@pytest.mark.timeout(30)
def test_the_openai_sdk_reads_code_and_param(app: Any) -> None:
    async def run() -> list[openai.APIStatusError]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport) as http:
            sdk = openai.AsyncOpenAI(
                base_url="http://gateway/v1", api_key=KEY, http_client=http, max_retries=0
            )
            messages: Any = [{"role": "user", "content": "hi"}]
            errors = []
            for request in (
                sdk.chat.completions.create(model="fake", messages=messages, temperature=-1),
                sdk.completions.create(model="fake", prompt="hi", top_p=2),
                sdk.chat.completions.create(model="nope", messages=messages),
                sdk.completions.create(model="fake", prompt="a" * 3_000_000),
                sdk.chat.completions.create(
                    model="fake", messages=[{"role": "user", "content": "a" * 5_000_000}]
                ),
            ):
                with pytest.raises(openai.APIStatusError) as caught:
                    await request
                errors.append(caught.value)
            return errors

    temperature, top_p, model, job_size, body_size = asyncio.run(run())
    assert isinstance(temperature, openai.BadRequestError)
    assert (temperature.code, temperature.param, temperature.type) == (IRE, "temperature", IRE)
    assert (top_p.status_code, top_p.param) == (400, "top_p")
    assert isinstance(model, openai.NotFoundError)
    assert (model.code, model.param, model.type) == ("model_not_found", "model", "not_found_error")
    assert (job_size.status_code, job_size.code, job_size.param) == (413, "request_too_large", "prompt")
    assert (body_size.status_code, body_size.code, body_size.param) == (413, "request_too_large", None)
