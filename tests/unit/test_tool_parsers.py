"""Tool-call and reasoning parsers on recorded model texts (the shapes Qwen 2.5/3, Llama 3.1 and
Mistral write), whole and streamed in random splits: the deltas join into the whole parse."""

from __future__ import annotations

import json
import random

import pytest

from qworker.openai.chat_output import MessageStream, OutputParsing, parse_message
from qworker.openai.reasoning import DEEPSEEK_R1, QWEN3, split_reasoning
from qworker.openai.tool_parsers import (
    FORCED_ARGUMENTS,
    FORCED_WRAPPED,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ToolCalling,
    ToolCallStream,
    join_deltas,
    parser_for_template,
)

NAMES = ("get_weather", "get_time")

# Recorded (Qwen2.5-7B-Instruct, Hermes format), lightly trimmed.
HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
HERMES_TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": {"h24": true}}}'
    "\n</tool_call>"
)
HERMES_TEXT_BEFORE = "Let me check the weather for you.\n\n" + HERMES_ONE
HERMES_BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
HERMES_UNKNOWN = '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>'
HERMES_NO_CALL = "The weather in Paris is usually mild; <b>no</b> tool needed."
# Llama-3.1-8B-Instruct, JSON tool calling.
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'
LLAMA_TAGGED_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "UTC"}}'
)
LLAMA_TEXT_BEFORE = 'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_BAD = '{"name": "get_weather", "parameters": {"city": "Paris"'
LLAMA_PLAIN_JSON = '{"answer": 42}'
# Mistral-7B-Instruct-v0.3 (special tokens kept).
MISTRAL_TWO = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"tz": "UTC"}}]'
)


def calls_of(text: str, parser: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, dict]]]:
    parsed = ToolCalling(parser, NAMES, parallel).make_parser().parse(text, is_final=True)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def streamed(text: str, tool_calling: ToolCalling, rng: random.Random) -> tuple[str, list[dict]]:
    stream = ToolCallStream(tool_calling.make_parser(), "seed")
    deltas = []
    i = 0
    while i < len(text):
        step = rng.randint(1, 7)
        deltas += stream.feed(text[i : i + step])
        i += step
    deltas += stream.finish()
    return join_deltas(deltas)


def test_hermes_one_two_text_before_and_malformed():
    assert calls_of(HERMES_ONE, HERMES) == (None, [("get_weather", {"city": "Paris", "unit": "C"})])
    content, calls = calls_of(HERMES_TWO, HERMES)
    assert content is None and [c[0] for c in calls] == ["get_weather", "get_time"]
    assert calls[1][1] == {"tz": "Europe/Paris", "fmt": {"h24": True}}
    assert calls_of(HERMES_TWO, HERMES, parallel=False)[1] == [("get_weather", {"city": "Paris"})]
    assert calls_of(HERMES_TEXT_BEFORE, HERMES) == (
        "Let me check the weather for you.",
        [("get_weather", {"city": "Paris", "unit": "C"})],
    )
    # Malformed: JSON that does not parse, an unknown function: the text comes back as content.
    assert calls_of(HERMES_BAD_JSON, HERMES) == (HERMES_BAD_JSON, [])
    assert calls_of(HERMES_UNKNOWN, HERMES) == (HERMES_UNKNOWN, [])
    assert calls_of(HERMES_NO_CALL, HERMES) == (HERMES_NO_CALL, [])
    # A bad block beside a good one: the good one is a call, the bad one content.
    content, calls = calls_of(HERMES_UNKNOWN + "\n" + HERMES_ONE, HERMES)
    assert content == HERMES_UNKNOWN and [c[0] for c in calls] == ["get_weather"]
    # A call cut at max_tokens is text.
    assert calls_of(HERMES_ONE[:40], HERMES) == (HERMES_ONE[:40], [])


def test_the_arguments_string_is_the_models_own_text():
    parsed = ToolCalling(HERMES, NAMES).make_parser().parse(HERMES_TWO, is_final=True)
    assert parsed.calls[1].arguments == '{"tz": "Europe/Paris", "fmt": {"h24": true}}'


def test_llama3_json_and_mistral():
    assert calls_of(LLAMA_ONE, LLAMA3_JSON) == (None, [("get_weather", {"city": "Paris", "unit": "C"})])
    content, calls = calls_of(LLAMA_TAGGED_TWO, LLAMA3_JSON)
    assert content is None and [c[0] for c in calls] == ["get_weather", "get_time"]
    # The format is the whole reply: text before it, broken JSON, JSON that is no call: content.
    for text in (LLAMA_TEXT_BEFORE, LLAMA_BAD, LLAMA_PLAIN_JSON, HERMES_NO_CALL):
        assert calls_of(text, LLAMA3_JSON) == (text, [])
    content, calls = calls_of("I will look.\n" + MISTRAL_TWO, MISTRAL)
    assert content == "I will look." and [c[0] for c in calls] == ["get_weather", "get_time"]
    assert calls_of('[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', MISTRAL)[1] == []


def test_forced_parsers():
    assert calls_of(' {"city": "Rome"} ', FORCED_ARGUMENTS)[1] == [("get_weather", {"city": "Rome"})]
    assert calls_of('{"city": "Ro', FORCED_ARGUMENTS) == ('{"city": "Ro', [])
    wrapped = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
    assert calls_of(wrapped, FORCED_WRAPPED) == (None, [("get_time", {"tz": "UTC"})])
    assert calls_of(wrapped[:-3], FORCED_WRAPPED) == (wrapped[:-3], [])


CASES = [
    (HERMES, t)
    for t in (HERMES_ONE, HERMES_TWO, HERMES_TEXT_BEFORE, HERMES_BAD_JSON, HERMES_UNKNOWN, HERMES_NO_CALL)
] + [
    (LLAMA3_JSON, t)
    for t in (LLAMA_ONE, LLAMA_TAGGED_TWO, LLAMA_TEXT_BEFORE, LLAMA_PLAIN_JSON, HERMES_NO_CALL)
]
CASES += [(MISTRAL, MISTRAL_TWO), (MISTRAL, "Hi " + MISTRAL_TWO), (MISTRAL, HERMES_NO_CALL)]
CASES += [
    (FORCED_ARGUMENTS, '\n{"city": "Paris", "unit": "F"}'),
    (FORCED_WRAPPED, '{"name": "get_time", "arguments": {}}'),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("parser", "text"), CASES)
def test_streamed_in_random_splits_joins_into_the_whole_parse(parser, text):
    tool_calling = ToolCalling(parser, NAMES)
    whole = parse_message(OutputParsing(tool_calling), text, "seed")
    for trial in range(25):
        content, calls = streamed(text, tool_calling, random.Random(trial))
        assert content == (whole.content or "")
        expected = [
            {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in whole.tool_calls or []
        ]
        assert calls == expected, (trial, calls)


def test_a_stream_sends_the_name_first_then_fragments():
    # A forced call streams as it is generated.
    stream = ToolCallStream(ToolCalling(FORCED_ARGUMENTS, NAMES).make_parser(), "s")
    arguments = '{"city": "Paris", "unit": "C"}'
    deltas = [d for c in arguments for d in stream.feed(c)] + stream.finish()
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 20 and "".join(fragments) == arguments  # spaces wait for what follows
    # A free one once its block has closed: the name, then the arguments.
    stream = ToolCallStream(ToolCalling(HERMES, NAMES).make_parser(), "s")
    deltas = [d for c in HERMES_TWO for d in stream.feed(c)]
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0, 1, 1] and not stream.finish()
    assert deltas[1]["tool_calls"][0]["function"] == {"arguments": '{"city": "Paris"}'}


def test_parser_from_the_chat_template():
    assert parser_for_template(None) == HERMES
    assert parser_for_template("{{ messages }}") == HERMES  # renders no tools: the fallback message's format
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert parser_for_template("{% if tools %}<|start_header_id|>ipython{% endif %}") == LLAMA3_JSON
    assert parser_for_template("{% if tools %}[AVAILABLE_TOOLS][TOOL_CALLS]{% endif %}") == MISTRAL
    assert parser_for_template("{% for t in tools %}{{ t }}{% endfor %}") is None


# -- reasoning -------------------------------------------------------------------------------------

# Qwen3-0.6B, thinking on; thinking off (the template pre-fills an empty block: no tags in the reply).
QWEN3_THINKING = "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is **4**."
QWEN3_NOT_THINKING = "The answer is **4**."
QWEN3_CUT = "<think>\nLet me count: one, two"
QWEN3_TOOL = (
    "<think>\nI should call the weather tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
R1_NO_OPEN = "Okay, 2+2 is 4.\n</think>\n\nIt is 4."


def test_reasoning_split():
    split = split_reasoning(QWEN3, QWEN3_THINKING, is_final=True)
    assert split.reasoning == "The user asks for 2+2. That is 4." and split.content == "The answer is **4**."
    split = split_reasoning(QWEN3, QWEN3_NOT_THINKING, is_final=True)
    assert split.reasoning is None and split.content == QWEN3_NOT_THINKING
    split = split_reasoning(QWEN3, QWEN3_CUT, is_final=True)
    assert split.reasoning == "Let me count: one, two" and split.content is None
    split = split_reasoning(DEEPSEEK_R1, R1_NO_OPEN, is_final=True)
    assert split.reasoning == "Okay, 2+2 is 4." and split.content == "It is 4."
    assert split_reasoning(DEEPSEEK_R1, QWEN3_THINKING, is_final=True).content == "The answer is **4**."
    message = parse_message(OutputParsing(ToolCalling(HERMES, NAMES), QWEN3), QWEN3_TOOL, "s")
    assert message.reasoning == "I should call the weather tool." and message.content is None
    assert message.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("parser", "text", "tools"),
    [
        (QWEN3, QWEN3_THINKING, False),
        (QWEN3, QWEN3_NOT_THINKING, False),
        (QWEN3, QWEN3_CUT, False),
        (QWEN3, QWEN3_TOOL, True),
        (DEEPSEEK_R1, R1_NO_OPEN, False),
        (DEEPSEEK_R1, QWEN3_TOOL, True),
    ],
)
def test_reasoning_streamed_in_random_splits_joins_into_the_whole(parser, text, tools):
    parsing = OutputParsing(ToolCalling(HERMES, NAMES) if tools else None, parser)
    whole = parse_message(parsing, text, "seed")
    for trial in range(25):
        rng = random.Random(trial)
        stream = MessageStream(parsing, "seed")
        deltas, i = [], 0
        while i < len(text):
            step = rng.randint(1, 6)
            deltas += stream.feed(text[i : i + step])
            i += step
        deltas += stream.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        assert reasoning == "".join(d.get("reasoning", "") for d in deltas)
        content, calls = join_deltas(deltas)
        assert reasoning == (whole.reasoning or "") and content == (whole.content or "")
        assert [c["arguments"] for c in calls] == [c["function"]["arguments"] for c in whole.tool_calls or []]
