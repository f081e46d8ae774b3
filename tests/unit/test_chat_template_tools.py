"""Jobs with `tools` and `chat_template_kwargs` rendered through chat templates of the Qwen3 and
Llama 3.1 shapes (tests/data/chat_templates: written for these tests, in those families'
formats) and SmolLM2's, which renders no tools, by the worker's path (Job -> prepare_prompt ->
InputProcessor -> transformers' apply_chat_template) and by the gateway's (render_chat, which
counts the prompt): both give the same tokens."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from qworker.engine.input_processor import InputProcessor
from qworker.gateway.tokenizer import GatewayTokenizer, TokenizerNotFoundError, find_tokenizer_dir
from qworker.jobs.job import Job, decode_job
from qworker.openai.tool_parsers import HERMES, LLAMA3_JSON, parser_for_template
from qworker.worker.intake import prepare_prompt

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    try:
        return find_tokenizer_dir("smollm2", None)
    except TokenizerNotFoundError:
        pytest.skip("no converted SmolLM2 tokenizer here (a worker converts it once)")


def tokenizers_with(smollm2_dir: Path, template: str | None):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(smollm2_dir / "tokenizer.json"), bos_token="<|im_start|>")
    gateway = GatewayTokenizer.load("smollm2", str(smollm2_dir), None)
    if template is not None:
        hf.chat_template = template
        gateway.chat_template = template
        gateway.config = {"bos_token": "<|im_start|>"}
    else:
        hf.chat_template = gateway.chat_template
    return hf, gateway


def worker_text(hf, job: Job) -> tuple[str, list[int]]:
    processor = InputProcessor(hf, None, None, 0, 0)  # apply_chat_template needs the tokenizer only
    engine = SimpleNamespace(tokenizer=hf, apply_chat_template=processor.apply_chat_template)
    ids = prepare_prompt(engine, job)["prompt_token_ids"]
    return hf.decode(ids), ids


def check_gateway_counts_the_same(gateway, job: Job, ids: list[int]) -> None:
    text = gateway.render_chat(
        [m.model_dump() for m in job.messages],
        tools=job.template_tools(),
        chat_template_kwargs=job.chat_template_kwargs,
    )
    assert gateway.encode(text, add_special_tokens=False) == ids


@pytest.mark.timeout(60)
def test_qwen3_shape_renders_tools_and_enable_thinking(smollm2_dir):
    template = (TEMPLATES / "qwen3_tools.jinja").read_text()
    assert parser_for_template(template) == HERMES
    hf, gateway = tokenizers_with(smollm2_dir, template)
    job = decode_job(
        json.dumps(
            {"messages": CONVERSATION, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}
        ).encode(),
        "j1",
    )
    text, ids = worker_text(hf, job)
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    # enable_thinking reached the template: the empty think block after the generation prompt.
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    check_gateway_counts_the_same(gateway, job, ids)
    thinking, _ = worker_text(hf, Job(messages=CONVERSATION, tools=[WEATHER]))
    assert thinking.endswith("<|im_start|>assistant\n")


@pytest.mark.timeout(60)
def test_llama3_shape_renders_tools(smollm2_dir):
    template = (TEMPLATES / "llama3_tools.jinja").read_text()
    assert parser_for_template(template) == LLAMA3_JSON
    hf, gateway = tokenizers_with(smollm2_dir, template)
    job = Job(messages=CONVERSATION, tools=[WEATHER])
    text, ids = worker_text(hf, job)
    assert "Environment: ipython" in text and json.dumps(WEATHER, indent=4) in text
    assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 21}' in text
    check_gateway_counts_the_same(gateway, job, ids)


@pytest.mark.timeout(60)
def test_a_template_without_tools_gets_them_in_a_system_message(smollm2_dir):
    hf, gateway = tokenizers_with(smollm2_dir, None)
    assert "tools" not in hf.chat_template and parser_for_template(hf.chat_template) == HERMES
    job = Job(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    text, ids = worker_text(hf, job)
    assert text.startswith("<|im_start|>system\nYou may call these functions.")
    assert '"name":"get_weather"' in text and "<tool_call>" in text
    check_gateway_counts_the_same(gateway, job, ids)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"prompt": "x", "tools": [WEATHER]}, "tools is for chat jobs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "cannot set 'add_generation_prompt'"),
        ({"chat_template_kwargs": {"not a name": 1}}, "not a template variable name"),
        ({"chat_template_kwargs": {"x": "a" * 20000}}, "bytes of JSON"),
        ({"tools": [WEATHER, WEATHER]}, "more than once"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ],
)
def test_job_tool_fields_are_validated(fields, words):
    from qworker.jobs.job import JobDecodeError

    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    if "prompt" in fields:
        del body["messages"]
    with pytest.raises(JobDecodeError) as caught:
        decode_job(json.dumps(body).encode(), "j")
    assert words in caught.value.message
