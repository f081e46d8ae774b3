"""Structured output through a worker's Redis stream: constrained jobs and hostile
`structured_outputs` values in one burst of a real `qworker worker` (the tiny random Llama with
SmolLM2's tokenizer, so grammars compile for a real vocabulary). Every entry ends with one
outcome; constrained jobs that run match their constraint; a constraint that fails fails its job
alone, with a named error type; the good jobs beside them complete. Plus a hypothesis fuzz of
`response_format` / `tools` / `structured_outputs` through batch-row parsing (the gateway's and
`qworker batch`'s door): every body is a RowError or a row whose params build.
"""

from __future__ import annotations

import json
import re
import uuid

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.backends.redis import keys as constants
from qworker.jobs.job import JobResult, JobStatus
from qworker.openai.format import RowError
from qworker.openai.rows import parse_row
from tests.integration.conftest import raw_redis

from .stream_fuzz import Entry, check_outcomes, generate, run_burst_worker, write_entries

PROMPT = {"prompt_token_ids": [1, 520, 3000, 17]}

hostile_constraints = st.one_of(
    st.dictionaries(
        st.sampled_from(
            ["json", "regex", "choice", "grammar", "json_object", "whitespace_pattern", "jsn", ""]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**70), 2**70),
            st.text(max_size=12),
            st.lists(st.text(max_size=4), max_size=3),
            st.sampled_from(
                [
                    {"type": "object"},
                    {"type": "foo"},
                    {"type": "string", "pattern": "(a+)+$"},
                    {"$ref": "#/definitions/missing"},
                    {"type": "array", "minItems": 10**9},
                    "[" * 300,
                    "(a|b)*a(a|b){40}",
                    "start: start start | ",
                ]
            ),
        ),
        max_size=3,
    ),
    st.sampled_from([None, "json", 0, [], {"json": {"type": "object"}, "regex": "x"}, "x" * 3000]),
)


def constrained_entry(job_id: str, constraint, max_tokens: int = 12) -> Entry:
    body = {
        **PROMPT,
        "params": {"max_tokens": max_tokens, "temperature": 1.0, "structured_outputs": constraint},
    }
    return Entry({b"id": job_id.encode(), b"job": json.dumps(body).encode()}, kind="structured")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_constrained_and_hostile_jobs_in_one_burst(url, tiny_model_dir, tmp_path):
    r = raw_redis(url)
    params = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params
    stream, group, prefix = params["stream"], params["group"], params["prefix"]
    r.xgroup_create(stream, group, id="0", mkstream=True)
    checks = {
        "so-regex": ({"regex": "[0-9]{2,4}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{2,4}-[a-z]{2}", t)),
        "so-choice": ({"choice": ["red", "green", "blue"]}, lambda t: t in {"red", "green", "blue"}),
        "so-grammar": ({"grammar": 'start: "x" "y"* "z"'}, lambda t: re.fullmatch("xy*z", t)),
    }
    failing = {
        "so-bad-type": {"json": {"type": "foo"}},
        "so-bad-grammar": {"grammar": "start: nothing_here"},
        "so-bad-regex": {"regex": "(unclosed"},
    }
    refused_at_intake = {
        "so-two": {"json": True, "regex": "a"},
        "so-unknown": {"guided_json": {}},
        "so-not-json": {"json": "{nope"},
        "so-deep": {"json": "[" * 5000 + "]" * 5000},
    }
    entries = [constrained_entry(job_id, c, max_tokens=24) for job_id, (c, _) in checks.items()]
    entries += [constrained_entry(job_id, c) for job_id, c in {**failing, **refused_at_intake}.items()]
    entries += [constrained_entry(f"so-json-{i}", {"json": True}, max_tokens=16) for i in range(3)]
    hostile = st.lists(hostile_constraints, min_size=40, max_size=40)
    drawn = []

    @settings(max_examples=1, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(hostile)
    def draw(values):
        drawn.extend(values)

    draw()
    entries += [
        constrained_entry(f"so-fuzz-{i}-{uuid.uuid4().hex[:6]}", value) for i, value in enumerate(drawn)
    ]
    entries += [e for e in generate(num_batches=2, seed=None) if e.kind == "good"]
    message_ids = write_entries(r, stream, entries)
    log_path = tmp_path / "worker.log"
    returncode = run_burst_worker(url, tiny_model_dir, log_path, timeout_s=200)
    log = log_path.read_text()
    assert returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    outcomes = check_outcomes(r, url, entries, message_ids)
    assert not outcomes.problems, outcomes.problems[:20]
    assert outcomes.num_results == len(entries)

    def result(job_id: str) -> JobResult:
        return JobResult.model_validate_json(r.get(constants.result_key(prefix, job_id)))

    for job_id, (_, check) in checks.items():
        done = result(job_id)
        assert done.status is JobStatus.COMPLETED and done.finish_reason == "stop", done
        assert check(done.text), (job_id, done.text)
    for job_id in failing:
        done = result(job_id)
        assert done.status is JobStatus.FAILED and done.error.type == "StructuredOutputError", done
    for job_id in refused_at_intake:
        done = result(job_id)
        assert done.status is JobStatus.FAILED and "structured_outputs" in done.error.message, done
    for i in range(3):
        done = result(f"so-json-{i}")
        assert done.status is JobStatus.COMPLETED
        if done.finish_reason == "stop":
            assert isinstance(json.loads(done.text), dict)
    assert outcomes.error_types["StructuredOutputError"] >= len(failing)


response_formats = st.one_of(
    st.none(),
    st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
            },
            {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
            {"type": "json_schema", "json_schema": {"schema": {}}},
            {"type": "json_schema"},
            {"type": "xml"},
            {"type": "json_object", "extra": 1},
        ]
    ),
    st.dictionaries(st.text(max_size=6), st.text(max_size=6) | st.integers(), max_size=2),
    st.text(max_size=5),
)
tools = st.one_of(
    st.none(),
    st.just([]),
    st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    st.just(
        [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    ),
    st.lists(st.dictionaries(st.sampled_from(["type", "function", "x"]), st.text(max_size=4)), max_size=2),
)
tool_choices = st.sampled_from(
    [None, "none", "auto", "required", {"type": "function", "function": {"name": "f"}}, {"function": "f"}, 3]
)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(response_formats, hostile_constraints, tools, tool_choices)
def test_fuzzed_constraint_fields_in_rows_are_a_row_error_or_a_runnable_row(
    response_format, structured, tool_list, tool_choice
):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for name, value in (
        ("response_format", response_format),
        ("structured_outputs", structured),
        ("tools", tool_list),
        ("tool_choice", tool_choice),
    ):
        if value is not None:
            body[name] = value
    try:
        row = parse_row("c", "/v1/chat/completions", body, batch_id="b", served_model_names=["smollm2"])
    except RowError as exc:
        assert exc.status_code == 400 and str(exc)
        return
    # Accepted: the params build, and the constraint asked for is the one taken.
    params = row.sampling_params(4)
    is_forced = bool(tool_list) and tool_choice not in (None, "none", "auto")
    assert (row.forced_tool is not None) == is_forced
    asks_json = isinstance(response_format, dict) and response_format.get("type") != "text"
    if is_forced or asks_json:
        assert params.structured_outputs is not None and params.structured_outputs.kind == "json"
    elif structured is None:
        assert params.structured_outputs is None


SMALL_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CALL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]},
    },
}


@pytest.mark.timeout(180)
def test_a_batch_file_with_response_format_and_tool_rows(tmp_path):
    """`qworker batch` (local mode, the tiny model with SmolLM2's tokenizer): response_format,
    structured_outputs and forced-tool rows run constrained, an auto-tool row runs; refused rows
    get 400 lines."""
    from typer.testing import CliRunner

    from qworker import cli
    from tests.integration.batch_support import (
        CHAT_URL,
        MODEL_NAME,
        batch_row,
        engine_flags,
        read_output,
        write_batch_model_dir,
        write_jsonl,
    )

    model_dir = write_batch_model_dir(tmp_path / "model")

    def chat(custom_id: str, **fields) -> dict:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "A person?"}],
            "max_tokens": 48,
            **fields,
        }
        return batch_row(custom_id, CHAT_URL, body)

    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SMALL_PERSON, "strict": True},
    }
    compact = {"json": SMALL_PERSON, "disable_any_whitespace": True}
    rows = [
        chat("schema", response_format=schema_format, temperature=0),
        chat("schema-n3", response_format=schema_format, temperature=1.0, seed=3, n=3),
        chat("compact", structured_outputs=compact, temperature=0),
        chat("object", response_format={"type": "json_object"}, max_tokens=8),
        chat("text", response_format={"type": "text"}, max_tokens=4),
        chat("tool", tools=[CALL], tool_choice="required", temperature=0),
        chat("auto", tools=[CALL], tool_choice="auto"),
        chat("two", response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        chat(
            "refused",
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
        ),
    ]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    flags = ["-i", str(source), "-o", str(out), "--errors", str(errors), "--served-model-name", MODEL_NAME]
    flags += ["--work-dir", str(tmp_path / "work"), *engine_flags(model_dir)]
    result = CliRunner().invoke(cli.app, ["batch", *flags])
    assert result.exit_code == 0, result.output
    done = {line.custom_id: line for line in read_output(out)}
    failed = {line.custom_id: line for line in read_output(errors)}
    # tool_choice auto runs unconstrained; its text is read for Hermes calls.
    assert set(done) == {"schema", "schema-n3", "compact", "object", "text", "tool", "auto"}, (done, failed)
    assert set(failed) == {"two", "refused"}
    assert all(line.response.status_code == 400 for line in failed.values())
    assert "Unimplemented keys" in failed["refused"].error.message
    for custom_id in ("schema", "schema-n3", "compact"):
        for choice in done[custom_id].response.body.choices:
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), SMALL_PERSON)
            else:
                assert choice.finish_reason == "length"
    assert len(done["schema-n3"].response.body.choices) == 3
    # Compact JSON: no whitespace outside the strings.
    outside_strings = re.sub(
        r'"(?:[^"\\]|\\.)*"', "", done["compact"].response.body.choices[0].message.content
    )
    assert not re.search(r"\s", outside_strings), outside_strings
    num_stopped = sum(
        c.finish_reason == "stop"
        for k in ("schema", "schema-n3", "compact")
        for c in done[k].response.body.choices
    )
    assert num_stopped >= 1, "no constrained output completed: the checks above saw only prefixes"
    tool = done["tool"].response.body.choices[0]
    if tool.finish_reason == "tool_calls":
        [call] = tool.message.tool_calls
        assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"])["n"] in (
            1,
            2,
            3,
        )
    else:
        assert tool.finish_reason == "length"
