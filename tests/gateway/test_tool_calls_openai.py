"""Tool calls and reasoning through the gateway with the official openai SDK (and LangChain),
against the suite's SmolLM2 worker: a `structured_outputs` regex steers the model into a Hermes
`<tool_call>` under tool_choice "auto" (SmolLM2's template renders no tools, so the gateway reads
calls with the hermes parser), streamed and not; a forced call streamed as tool_calls deltas (the
defect of issue 43: it used to stream as content); reasoning split off by a second gateway on the
same pool, started with --reasoning-parser deepseek_r1."""

from __future__ import annotations

import json

import openai
import pytest

from qworker.gateway.app import create_app
from qworker.gateway.settings import GatewaySettings
from tests.gateway.conftest import API_KEY, serve_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Hermes call, as a regex (llguidance's syntax, anchored at both ends).
CALL_REGEX = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,10}", "unit": "[CF]"\}\}\n</tool_call>'
)


def assemble(stream) -> tuple[str, list[dict[str, str]], str | None, str]:
    """(content, calls, finish_reason, reasoning) a client assembles from the chunks."""
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                if part.id:
                    assert not call["id"], "the id comes once, with the name"
                    call["id"] = part.id
                    assert part.type == "function" and part.function.name
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, reasoning


def as_calls(message) -> list[dict[str, str]]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]


def without_ids(calls: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


@pytest.mark.timeout(240)
def test_auto_tool_choice_streamed_and_not(sdk, worker):
    common = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 64,
        "temperature": 0,
        "tools": [WEATHER],
        "tool_choice": "auto",
        "extra_body": {"structured_outputs": {"regex": CALL_REGEX}},
    }
    response = sdk.chat.completions.create(**common)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Let me check."
    [call] = as_calls(choice.message)
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(json.loads(call["arguments"])) == {"city", "unit"}
    content, calls, finish, _ = assemble(sdk.chat.completions.create(**common, stream=True))
    assert (content, without_ids(calls), finish) == ("Let me check.", without_ids([call]), "tool_calls")
    # "none": the same text is content; no tools shown, none read.
    plain = sdk.chat.completions.create(**{**common, "tool_choice": "none"})
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_streams_as_tool_call_deltas(sdk, worker, tool_choice):
    common = {
        "model": "smollm2",
        "messages": ASK,
        "max_tokens": 48,
        "temperature": 0,
        "tools": [WEATHER],
        "tool_choice": tool_choice,
    }
    whole = sdk.chat.completions.create(**common).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    chunks = list(sdk.chat.completions.create(**common, stream=True))
    content, calls, finish, _ = assemble(chunks)
    # The defect: the call came as content deltas with finish_reason tool_calls.
    assert content == "" and finish == "tool_calls"
    assert without_ids(calls) == without_ids(as_calls(whole.message))
    fragments = [
        c.choices[0].delta.tool_calls[0].function.arguments
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert fragments[0] == "" and len(fragments) > 2  # the name first, then the arguments in pieces


@pytest.mark.timeout(240)
def test_langchain_bind_tools_auto(gateway, worker):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    chat = langchain_openai.ChatOpenAI(
        base_url=gateway.base_url,
        api_key=API_KEY,
        model="smollm2",
        temperature=0,
        max_tokens=64,
        max_retries=0,
        extra_body={"structured_outputs": {"regex": CALL_REGEX}},
    )
    message = chat.bind_tools([WEATHER], tool_choice="auto").invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    person = langchain_openai.ChatOpenAI(
        base_url=gateway.base_url,
        api_key=API_KEY,
        model="smollm2",
        temperature=0,
        max_tokens=48,
        max_retries=0,
    ).with_structured_output(Person)
    assert isinstance(person.invoke("Describe a person."), Person)


@pytest.fixture(scope="module")
def reasoning_sdk(pool_url):
    app = create_app(
        GatewaySettings(request_timeout_s=120, reasoning_parser="deepseek_r1"),
        queue=pool_url,
        api_keys=frozenset({API_KEY}),
    )
    with serve_app(app) as served:
        yield openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.mark.timeout(240)
def test_reasoning_is_split_off_streamed_and_not(reasoning_sdk, worker):
    common = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Is 7 a prime?"}],
        "max_tokens": 48,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": r"<think>[a-z ]{4,30}</think>\n\n(Yes|No)\."}},
    }
    message = reasoning_sdk.chat.completions.create(**common).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.model_extra["reasoning"] == reasoning and "<think>" not in reasoning
    assert message.content in ("Yes.", "No.")
    content, _, finish, streamed_reasoning = assemble(
        reasoning_sdk.chat.completions.create(**common, stream=True)
    )
    assert (content, streamed_reasoning, finish) == (message.content, reasoning, "stop")
