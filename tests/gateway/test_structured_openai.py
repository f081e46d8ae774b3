"""Structured output through the gateway with the official openai SDK, unchanged: response_format
(json_schema and json_object), a forced tool call returned as tool_calls, the round trip with the
call and its result in the conversation, and the refusals (a bad tool_choice, two constraints, a
schema the backend refuses). The gateway suite's SmolLM2 worker serves them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
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
ASK = [{"role": "user", "content": "Describe a person, as JSON."}]


@pytest.mark.timeout(180)
def test_response_format_json_schema_and_json_object(sdk, worker):
    response = sdk.chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=48,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    response = sdk.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=48, temperature=0, response_format={"type": "json_object"}
    )
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)


@pytest.mark.timeout(180)
def test_forced_tool_call_and_its_round_trip(sdk, worker):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = sdk.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=40,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The round trip: the assistant's call and the tool's answer go back in the conversation.
    follow_up = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = sdk.chat.completions.create(model="smollm2", messages=follow_up, max_tokens=16, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    required = sdk.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=40,
        temperature=0,
        tools=[WEATHER],
        tool_choice="required",
    )
    if required.choices[0].finish_reason == "tool_calls":
        assert required.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.timeout(120)
def test_what_cannot_run_is_a_clear_400(sdk, worker):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        sdk.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=4, tools=[WEATHER], tool_choice="sometimes"
        )
    with pytest.raises(openai.BadRequestError, match="give one"):
        sdk.chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=4,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"regex": "a+"}},
        )
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        sdk.chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=4, extra_body={"structured_outputs": {"jsonschema": {}}}
        )
    # Refused by the backend, in the worker: the job fails alone, and the gateway says why.
    with pytest.raises(openai.APIStatusError, match="Unknown format"):
        sdk.chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "html-selector"}},
            },
        )
    regex = sdk.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=16, extra_body={"structured_outputs": {"regex": "[a-c]{3}"}}
    )
    assert len(regex.choices[0].message.content) == 3 and set(regex.choices[0].message.content) <= set("abc")
