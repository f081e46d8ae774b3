"""The batch file format without a model: body fields onto SamplingParams by their OpenAI names,
per-row errors, the "not supported yet" switch, response bodies and logprob shapes built from
hand-made objects of vLLM's output shapes, the whole-file check, the resumable output, the
journal of sent rows, S3-style chunked reads and the progress summary."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

import pytest

from qworker.engine.outputs import CompletionOutput
from qworker.jobs.job import JobError, JobResult, JobStatus
from qworker.openai import rows as rows_module
from qworker.openai.batches.files import Location, split_lines
from qworker.openai.batches.output import OutputFileError, done_custom_ids
from qworker.openai.batches.pool import SubmittedJournal, error_of_result, job_for, line_of_result
from qworker.openai.batches.progress import BatchSummary, Progress, ProgressMode
from qworker.openai.batches.validate import BatchFileError, check_input
from qworker.openai.bodies import (
    Generation,
    choice_logprobs_chat,
    choice_logprobs_completion,
    response_body,
    top_entries,
)
from qworker.openai.format import MIN_LOGPROB, BatchOutputLine, RowError, Usage, error_line, success_line
from qworker.openai.rows import Endpoint, parse_row, request_id_for, sampling_kwargs

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SERVED = ["tiny", "tiny-alias"]
IRE = "invalid_request_error"
UNS = "unsupported_parameter"


def parse(body: dict, url: str = CHAT, custom_id: str = "r1"):
    return parse_row(custom_id, url, body, batch_id="b1", served_model_names=SERVED)


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **extra}


def user(content, **extra) -> dict:
    return {"role": "user", "content": content, **extra}


TOOL_F = {"type": "function", "function": {"name": "f"}}


def row_error(body: dict, url: str = CHAT) -> RowError:
    with pytest.raises(RowError) as info:
        parse(body, url)
    return info.value


# -- body -> SamplingParams ---------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_openai_and_vllm_names_reach_sampling_params():
    row = parse(
        chat_body(
            max_completion_tokens=7,
            max_tokens=99,
            temperature=0.5,
            top_p=0.9,
            seed=11,
            stop="END",
            top_k=5,
            min_p=0.1,
            min_tokens=2,
            ignore_eos=True,
            stop_token_ids=[3],
            n=1,
            logprobs=False,
            frequency_penalty=0.5,
            presence_penalty=-1,
            repetition_penalty=1.1,
            logit_bias={"5": 10, "7": -100},
            allowed_token_ids=[5, 7, 9],
            bad_words=["no"],
            truncate_prompt_tokens=100,
            user="someone",
        )
    )
    assert row.endpoint is Endpoint.CHAT and row.model == "tiny"
    assert row.max_tokens == 7, "chat: max_completion_tokens wins over max_tokens"
    params = row.sampling_params(row.max_tokens)
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0.5, 0.9, 11)
    assert (params.stop, params.top_k, params.min_p, params.min_tokens) == (["END"], 5, 0.1, 2)
    assert params.ignore_eos and params.stop_token_ids == [3]
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == (0.5, -1.0, 1.1)
    assert params.logit_bias == {5: 10.0, 7: -100.0} and params.allowed_token_ids == [5, 7, 9]
    assert params.bad_words == ["no"] and params.truncate_prompt_tokens == 100
    assert row.num_top_logprobs is None
    assert parse(chat_body(max_tokens=9)).max_tokens == 9
    assert parse(chat_body()).max_tokens is None, "chat without a limit: to the end of the context"
    text = parse({"model": "tiny-alias", "prompt": "Once"}, COMPLETIONS)
    assert text.endpoint is Endpoint.COMPLETIONS and text.prompt == "Once" and text.model == "tiny-alias"
    assert text.max_tokens == 16, "OpenAI's completions default"
    assert parse({"prompt": [[5, 6, 7]]}, COMPLETIONS).prompt == [5, 6, 7]
    assert parse({"prompt": ["one"]}, COMPLETIONS).prompt == "one"
    assert parse({"prompt": "x"}, COMPLETIONS).model == "tiny", "no model: the first served name"
    assert parse({"prompt": "x", "max_tokens": None}, COMPLETIONS).max_tokens == 16


@pytest.mark.timeout(10)
def test_messages_take_text_parts_and_names():
    row = parse(
        chat_body(
            messages=[
                {"role": "system", "content": "Be brief.", "name": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        )
    )
    assert row.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]


@pytest.mark.timeout(10)
def test_row_ids_are_derived_from_the_batch_and_the_custom_id():
    assert (
        request_id_for("b1", "x") == request_id_for("b1", "x") == parse(chat_body(), custom_id="x").request_id
    )
    assert request_id_for("b1", "x") != request_id_for("b2", "x") != request_id_for("b1", "y")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("body", "url", "status", "code", "words"),
    [
        (chat_body(), "/v1/embeddings", 400, "invalid_url", "not supported"),
        ([1, 2], CHAT, 400, IRE, "body must be a JSON object"),
        (chat_body(model="gpt-4"), CHAT, 404, "model_not_found", "'gpt-4' does not exist"),
        (chat_body(stream=True), CHAT, 400, IRE, "stream"),
        (chat_body(temperature=-1), CHAT, 400, IRE, "temperature"),
        (chat_body(top_p=0), CHAT, 400, IRE, "top_p"),
        (chat_body(max_tokens=0), CHAT, 400, IRE, "max_tokens"),
        (chat_body(min_tokens=9, max_tokens=3), CHAT, 400, IRE, "min_tokens"),
        (chat_body(stop=5), CHAT, 400, IRE, "stop"),
        (chat_body(frequency_penalty=2.5), CHAT, 400, IRE, "frequency_penalty must be in [-2, 2]"),
        (chat_body(repetition_penalty=0), CHAT, 400, IRE, "repetition_penalty must be > 0"),
        (chat_body(logit_bias={"5": 101}), CHAT, 400, IRE, "logit_bias[5] must be in [-100, 100]"),
        (chat_body(allowed_token_ids=[]), CHAT, 400, IRE, "allowed_token_ids must be a non-empty"),
        (chat_body(tools=[{"type": "function"}]), CHAT, 400, IRE, "tools[0]"),
        (chat_body(tools=[TOOL_F], parallel_tool_calls="yes"), CHAT, 400, IRE, "parallel_tool_calls"),
        (chat_body(chat_template_kwargs={"tools": []}), CHAT, 400, IRE, "cannot set 'tools'"),
        (chat_body(temprature=0), CHAT, 400, IRE, "unknown field(s) for chat: temprature"),
        (chat_body(echo=True), CHAT, 400, IRE, "unknown field(s) for chat: echo"),
        (chat_body(messages=[]), CHAT, 400, IRE, "messages must be a non-empty list"),
        (chat_body(messages=[user([{"type": "image_url"}])]), CHAT, 400, IRE, "only text"),
        (chat_body(messages=[user("x", tool_calls=[])]), CHAT, 400, IRE, "tool_calls"),
        ({"prompt": ["a", "b"]}, COMPLETIONS, 400, IRE, "holds 2 prompts"),
        ({"prompt": ""}, COMPLETIONS, 400, IRE, "prompt is empty"),
        ({"prompt": [1, "x"]}, COMPLETIONS, 400, IRE, "prompt must be"),
        ({"prompt": [5, 6], "echo": True}, COMPLETIONS, 400, IRE, "echo needs a text prompt"),
        ({"prompt": "x", "max_completion_tokens": 3}, COMPLETIONS, 400, IRE, "unknown field"),
        (chat_body(affinity=7), CHAT, 400, IRE, "affinity must be a string"),
        (chat_body(affinity="k" * 257), CHAT, 400, IRE, "257 bytes"),
        (chat_body(affinity="\ud800"), CHAT, 400, IRE, "not valid Unicode"),
    ],
)  # fmt: skip
def test_rows_that_cannot_run_get_an_error_with_a_status(body, url, status, code, words):
    error = row_error(body, url)
    assert (error.status_code, error.code) == (status, code)
    assert words in error.message


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "field",
    [
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "bad_words",
        "truncate_prompt_tokens",
    ],
)
def test_logit_adjustments_out_of_range_name_their_field(field):
    bad = {
        "presence_penalty": -3,
        "frequency_penalty": "high",
        "repetition_penalty": -1.0,
        "logit_bias": {"1": 5, "x": 1},
        "bad_words": [""],
        "truncate_prompt_tokens": 0,
    }
    assert row_error(chat_body(**{field: bad[field]})).param == field


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("body", "url", "field"),
    [
        (chat_body(n=2), CHAT, "n"),
        (chat_body(logprobs=True), CHAT, "logprobs"),
        (chat_body(logprobs=True, top_logprobs=3), CHAT, "logprobs"),
        ({"prompt": "x", "logprobs": 0}, COMPLETIONS, "logprobs"),
        ({"prompt": "x", "logprobs": 2, "echo": True}, COMPLETIONS, "logprobs"),
        ({"prompt": "x", "n": 3}, COMPLETIONS, "n"),
    ],
)
def test_n_and_logprobs_rows_are_accepted_and_reach_sampling_params(body, url, field):
    assert not rows_module.PENDING_FIELDS
    row = parse(body, url)
    params = row.sampling_params(8)
    if field == "n":
        assert params.n == body["n"]
    else:
        assert params.logprobs == (
            body.get("top_logprobs") or (0 if body["logprobs"] is True else body["logprobs"])
        )
        assert params.prompt_logprobs == (params.logprobs if body.get("echo") else None)
    # The values meaning "off" leave the defaults.
    off = parse(chat_body(n=1, logprobs=False, top_logprobs=None)).sampling_params(8)
    assert (off.n, off.logprobs, off.prompt_logprobs) == (1, None, None)


@pytest.mark.timeout(10)
def test_n_and_logprobs_map_onto_vllm_names_once_the_switch_is_flipped(monkeypatch):
    monkeypatch.setattr(rows_module, "PENDING_FIELDS", frozenset())
    assert rows_module.asked_pending_fields(chat_body(n=2, logprobs=True)) == []
    chat = sampling_kwargs(chat_body(n=4, seed=7, logprobs=True, top_logprobs=3), Endpoint.CHAT, echo=False)
    assert chat.sampling == {"n": 4, "seed": 7, "logprobs": 3}
    assert chat.num_top_logprobs == 3 and chat.num_prompt_logprobs is None
    only_sampled = sampling_kwargs(chat_body(logprobs=True), Endpoint.CHAT, echo=False)
    assert only_sampled.sampling == {"logprobs": 0} and only_sampled.num_top_logprobs == 0
    text = sampling_kwargs({"prompt": "x", "logprobs": 2, "max_tokens": 5}, Endpoint.COMPLETIONS, echo=True)
    assert text.sampling == {"logprobs": 2, "prompt_logprobs": 2} and text.max_tokens == 5
    assert text.num_top_logprobs == 2 and text.num_prompt_logprobs == 2
    plain = sampling_kwargs({"prompt": "x", "n": 1}, Endpoint.COMPLETIONS, echo=False)
    assert plain.sampling == {} and plain.num_top_logprobs is None, "n=1 and no logprobs: nothing added"
    with pytest.raises(RowError, match="top_logprobs must be an integer in"):
        sampling_kwargs(chat_body(logprobs=True, top_logprobs=21), Endpoint.CHAT, echo=False)
    with pytest.raises(RowError, match="top_logprobs needs logprobs"):
        sampling_kwargs(chat_body(top_logprobs=2), Endpoint.CHAT, echo=False)
    with pytest.raises(RowError, match="n must be"):
        sampling_kwargs(chat_body(n=0), Endpoint.CHAT, echo=False)


# -- bodies ---------------------------------------------------------------------------------------


@dataclass
class Logprob:
    """vLLM's Logprob shape, built by hand."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class Completion:
    """vLLM's CompletionOutput shape, with logprobs."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class Output:
    """vLLM's RequestOutput shape."""

    prompt_token_ids: list[int]
    outputs: list[Completion]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class CachedOutput(Output):
    """With vLLM's num_cached_tokens (an Output without it is an engine that has none: 0)."""

    num_cached_tokens: int = 0


def round_trip(line: BatchOutputLine) -> BatchOutputLine:
    return BatchOutputLine.model_validate_json(line.model_dump_json())


@pytest.mark.timeout(10)
def test_chat_and_text_bodies_from_an_engine_output():
    output = Output(
        [1, 2, 3], [CompletionOutput(index=0, text=" Paris", token_ids=[9, 10], finish_reason="stop")]
    )
    chat = parse(chat_body(max_tokens=4))
    body = response_body(chat, Generation.from_request_output(output), created=123)
    line = round_trip(success_line(chat.custom_id, chat.request_id, body))
    assert not line.is_error and line.response.status_code == 200
    assert line.response.request_id == chat.request_id and line.custom_id == "r1"
    data = json.loads(line.model_dump_json())["response"]["body"]
    assert data["object"] == "chat.completion" and data["model"] == "tiny" and data["created"] == 123
    assert data["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": " Paris", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    # OpenAI's shape: prompt_tokens_details.cached_tokens is always there, 0 when nothing hit.
    assert data["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    echo = parse({"prompt": "The capital is", "echo": True}, COMPLETIONS)
    text = response_body(echo, Generation.from_request_output(output), created=1)
    assert text.object == "text_completion" and text.choices[0].text == "The capital is Paris"
    aborted = Output([1], [CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")])
    with pytest.raises(RowError) as info:
        response_body(chat, Generation.from_request_output(aborted), created=1)
    assert info.value.status_code == 500


@pytest.mark.timeout(10)
def test_error_lines_carry_the_status_the_body_and_the_error():
    error = RowError(
        "the model 'x' does not exist here", status_code=404, code="model_not_found", param="model"
    )
    line = round_trip(error_line("c", "rid", error))
    assert line.is_error and line.response.status_code == 404
    assert line.response.body.error.type == "not_found_error" and line.response.body.error.param == "model"
    assert line.error.code == "model_not_found" and "does not exist" in line.error.message


def lp(logprob: float, rank: int, text: str | None = None) -> Logprob:
    return Logprob(logprob=logprob, rank=rank, decoded_token=text)


@pytest.mark.timeout(10)
def test_top_entries_are_sorted_by_rank_and_the_sampled_token_only_where_its_rank_earns_it():
    # Token 7 was sampled at rank 3; the top two are 4 and 5.
    position = {7: lp(-2.5, 3, "c"), 4: lp(-0.1, 1, "a"), 5: lp(-1.0, 2, "b")}
    assert [token_id for token_id, _ in top_entries(position, 2)] == [4, 5]
    assert [token_id for token_id, _ in top_entries(position, 3)] == [4, 5, 7]
    unranked = {1: Logprob(-3.0), 2: Logprob(-0.5)}
    assert [token_id for token_id, _ in top_entries(unranked, 2)] == [2, 1], "no ranks: by logprob"


@pytest.mark.timeout(10)
def test_chat_logprobs_shape():
    token_ids = [7, 4]
    positions = [
        {7: lp(-2.5, 3, "c"), 4: lp(-0.1, 1, "a"), 5: lp(-1.0, 2, "b")},
        {4: lp(-math.inf, 1, None), 8: lp(-5.0, 2, "é")},
    ]
    out = choice_logprobs_chat(token_ids, positions, num_top=2, decode=lambda t: f"<{t}>")
    first, second = out.content
    assert (first.token, first.logprob, first.bytes) == ("c", -2.5, [99])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("a", -0.1), ("b", -1.0)]
    assert second.token == "<4>", "no decoded_token: the tokenizer's text"
    assert second.logprob == MIN_LOGPROB, "-inf is written as vLLM's floor"
    assert second.top_logprobs[1].bytes == list("é".encode())
    assert json.loads(out.model_dump_json())["content"][0]["top_logprobs"][0] == {
        "token": "a",
        "logprob": -0.1,
        "bytes": [97],
    }
    with pytest.raises(AssertionError, match="logprob positions"):
        choice_logprobs_chat([1, 2, 3], positions, num_top=1)


@pytest.mark.timeout(10)
def test_completion_logprobs_shape_with_echoed_prompt_positions():
    out = choice_logprobs_completion(
        [1, 2, 3],
        [None, {2: lp(-0.5, 1, "bc")}, {3: lp(-2.0, 2, "d"), 9: lp(-0.2, 1, "z")}],
        num_top=1,
        decode=lambda t: "A",
    )
    assert out.tokens == ["A", "bc", "d"]
    assert out.token_logprobs == [None, -0.5, -2.0]
    # The sampled "d" (rank 2) is not among the top 1, and OpenAI's legacy format still holds it.
    assert out.top_logprobs == [None, {"bc": -0.5}, {"z": -0.2, "d": -2.0}]
    assert out.text_offset == [0, 1, 3]


@pytest.mark.timeout(10)
def test_bodies_with_n_choices_and_logprobs_of_vllm_shape(monkeypatch):
    monkeypatch.setattr(rows_module, "PENDING_FIELDS", frozenset())
    # Rows asking for n and logprobs, built as they will be once SamplingParams has the fields.
    mapped = sampling_kwargs(chat_body(n=2, logprobs=True, top_logprobs=1), Endpoint.CHAT, echo=False)
    chat = rows_module.RowRequest(
        "c", "rid", Endpoint.CHAT, "tiny", [{"role": "user", "content": "x"}], None, mapped.sampling, 4,
        num_top_logprobs=mapped.num_top_logprobs,
    )  # fmt: skip
    output = Output(
        [1, 2],
        [
            Completion(1, "b", [6], "length", [{6: lp(-0.3, 1, "b")}]),
            Completion(0, "a", [5], "stop", [{5: lp(-0.7, 2, "a"), 6: lp(-0.2, 1, "b")}]),
        ],
    )
    body = response_body(chat, Generation.from_request_output(output), created=1)
    assert [c.index for c in body.choices] == [0, 1]
    assert body.choices[0].logprobs.content[0].top_logprobs[0].token == "b"
    assert body.usage.completion_tokens == 2
    text_mapped = sampling_kwargs({"prompt": "p q", "logprobs": 1}, Endpoint.COMPLETIONS, echo=True)
    text = rows_module.RowRequest(
        "t", "rid2", Endpoint.COMPLETIONS, "tiny", None, "p q", text_mapped.sampling, 2, echo=True,
        num_top_logprobs=1, num_prompt_logprobs=1,
    )  # fmt: skip
    scored = Output(
        [11, 12],
        [Completion(0, " r", [13], "length", [{13: lp(-1.5, 1, " r")}])],
        prompt_logprobs=[None, {12: lp(-0.9, 1, " q")}],
    )
    text_body = response_body(text, Generation.from_request_output(scored, with_prompt_logprobs=True), 1)
    logprobs = text_body.choices[0].logprobs
    assert text_body.choices[0].text == "p q r"
    assert logprobs.token_logprobs == [None, -0.9, -1.5] and logprobs.tokens[1:] == [" q", " r"]


# -- pool: jobs and results ----------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_rows_become_jobs_and_results_become_lines():
    chat = parse(chat_body(max_tokens=3, temperature=0))
    job = job_for(chat, default_max_tokens=100)
    assert job.id == chat.request_id and job.messages[0].content == "Hi" and job.params.max_tokens == 3
    assert job.metadata == {"custom_id": "r1"} and job.affinity is None
    assert job_for(parse(chat_body(affinity="task-3")), 100).affinity == "task-3"
    adapter_row = parse_row(
        "r2",
        CHAT,
        chat_body(model="tuned"),
        batch_id="b1",
        served_model_names=SERVED,
        adapter_names=["tuned"],
    )
    assert (adapter_row.model, job_for(adapter_row, 100).lora) == ("tuned", "tuned")
    assert job_for(parse(chat_body()), 100).lora is None
    assert job_for(parse(chat_body()), default_max_tokens=100).params.max_tokens == 100
    assert job_for(parse({"prompt": [4, 5]}, COMPLETIONS), 100).prompt_token_ids == [4, 5]
    assert job_for(parse({"prompt": "x"}, COMPLETIONS), 100).prompt == "x"
    with pytest.raises(RowError, match="prompt"):
        job_for(parse({"prompt": "x" * 1_000_001}, COMPLETIONS), 100)

    def failed(error_type: str) -> JobResult:
        return JobResult(id="a", status=JobStatus.FAILED, error=JobError(type=error_type, message="m"))

    cases = [
        (failed("PromptTooLongError"), 400),
        (failed("ValidationError"), 400),
        (failed("DeadLettered"), 500),
        (JobResult(id="a", status=JobStatus.TIMEOUT), 408),
        (JobResult(id="a", status=JobStatus.CANCELLED), 499),
    ]
    for result, status in cases:
        assert error_of_result(result).status_code == status, result
    assert error_of_result(cases[0][0]).code == "context_length_exceeded"


@pytest.mark.timeout(10)
def test_cached_tokens_reach_the_output_line_from_an_engine_output_and_from_a_job_result():
    chat = parse(chat_body(max_tokens=4))
    completion = CompletionOutput(index=0, text=" Paris", token_ids=[9, 10], finish_reason="stop")
    # Local mode (`qworker batch`): the engine's RequestOutput.num_cached_tokens.
    local = CachedOutput([1] * 20, [completion], num_cached_tokens=16)
    body = response_body(chat, Generation.from_request_output(local), created=1)
    line = json.loads(success_line(chat.custom_id, chat.request_id, body).model_dump_json())
    assert line["response"]["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    # Pool mode (`qworker batch --queue`, the Batch API): the stored result's usage, read back.
    stored = JobResult.model_validate_json(
        json.dumps(
            {
                "id": chat.request_id,
                "status": "completed",
                "text": " Paris",
                "token_ids": [9, 10],
                "finish_reason": "stop",
                "usage": {
                    "prompt_tokens": 20,
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 16},
                },
            }
        )
    )
    line_model, num_prompt, num_completion = line_of_result(chat, stored)
    usage = json.loads(line_model.model_dump_json())["response"]["body"]["usage"]
    assert (num_prompt, num_completion) == (20, 2)
    assert usage == {
        "prompt_tokens": 20,
        "completion_tokens": 2,
        "total_tokens": 22,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    # A result or an output line written before the field reads back with 0.
    old = JobResult.model_validate({"id": "a", "status": "completed", "usage": {"prompt_tokens": 3}})
    assert old.usage.prompt_tokens_details.cached_tokens == 0
    del usage["prompt_tokens_details"]
    assert Usage.model_validate(usage).prompt_tokens_details.cached_tokens == 0
    # Several prompts in one body (the gateway): summed, as prompt_tokens are.
    total = Usage.total([Usage.model_validate(line["response"]["body"]["usage"]), body.usage])
    assert (total.prompt_tokens, total.prompt_tokens_details.cached_tokens) == (40, 32)


# -- the whole-file check ------------------------------------------------------------------------


def write_lines(path, lines: list[str]) -> Location:
    path.write_text("".join(line + "\n" for line in lines))
    return Location(str(path), path=path)


def good(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": chat_body()})


@pytest.mark.timeout(10)
def test_the_whole_file_check_names_every_bad_line(tmp_path):
    location = write_lines(
        tmp_path / "in.jsonl",
        [
            good("a"),
            "{not json",
            "",
            json.dumps({"method": "POST", "url": CHAT, "body": {}}),
            good("a"),
            json.dumps({"custom_id": "b", "method": "GET", "url": CHAT, "body": {}}),
            json.dumps([1, 2]),
            json.dumps({"custom_id": 7, "method": "POST"}),
            good("c"),
        ],
    )
    with pytest.raises(BatchFileError) as info:
        check_input(location)
    problems = info.value.problems
    assert [p.split(":")[0] for p in problems] == ["line 2", "line 4", "line 5", "line 6", "line 7", "line 8"]
    assert "not JSON" in problems[0] and "no custom_id" in problems[1]
    assert "'a' repeats line 1" in problems[2] and "method must be POST, got 'GET'" in problems[3]
    assert "6 problems" in str(info.value)
    ok = check_input(write_lines(tmp_path / "ok.jsonl", [good("a"), "", good("b")]))
    assert ok.num_rows == 2 and ok.custom_ids == {"a", "b"}
    same = check_input(write_lines(tmp_path / "same.jsonl", [good("a"), "", good("b")]))
    assert same.content_hash == ok.content_hash, "the same content is the same batch"
    empty = check_input(write_lines(tmp_path / "empty.jsonl", []))
    assert empty.num_rows == 0


@pytest.mark.timeout(10)
def test_chunked_reads_split_lines_at_any_boundary():
    text = b'{"a": 1}\n\n{"b": 2}\n{"c": 3}'
    expected = [b'{"a": 1}', b"", b'{"b": 2}', b'{"c": 3}']
    for size in (1, 2, 3, 7, 100):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        assert list(split_lines(chunks)) == expected, size
    assert list(split_lines([b"x\n"])) == [b"x"]


# -- resume ----------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_resume_reads_done_ids_and_drops_a_cut_last_line(tmp_path, caplog):
    path = tmp_path / "out.jsonl"
    lines = [json.dumps({"custom_id": c, "response": None}) + "\n" for c in ("a", "b")]
    path.write_text("".join(lines) + '{"custom_id": "c", "resp')
    with caplog.at_level(logging.WARNING):
        assert done_custom_ids(path) == {"a", "b"}
    assert path.read_text() == "".join(lines), "the cut line is gone; complete ones stay"
    assert "unfinished last line" in caplog.text
    assert done_custom_ids(path) == {"a", "b"}
    path.write_text(lines[0] + "garbage\n" + lines[1])
    with pytest.raises(OutputFileError, match="line 2"):
        done_custom_ids(path)
    assert done_custom_ids(tmp_path / "missing.jsonl") == set()


@pytest.mark.timeout(10)
def test_the_journal_of_sent_rows_survives_a_cut_append(tmp_path):
    journal = SubmittedJournal(tmp_path / "j.submitted")
    journal.add(["a", "b"])
    with open(journal.path, "ab") as f:
        f.write(b"c")  # a kill in the middle of the next append
    again = SubmittedJournal(journal.path)
    assert "a" in again and "b" in again and "c" not in again
    again.clear()
    assert not journal.path.exists()


# -- progress ---------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_progress_counts_rows_and_logs_lines_off_a_terminal(caplog):
    summary = BatchSummary(num_input_rows=10, num_already_done=4)
    progress = Progress(summary, ProgressMode.AUTO, interval_s=0.0)
    assert progress.mode is ProgressMode.LOG, "pytest's stderr is not a terminal"
    progress.start()
    with caplog.at_level(logging.INFO, logger="qworker.batch"):
        progress.row_done(200, 10, 5)
        progress.row_done(404)
    done = progress.close()
    assert "batch progress: 2/6 rows (1 failed, 0 collected" in caplog.text and "ETA" in caplog.text
    assert (done.num_run, done.num_failed, done.num_completion_tokens) == (2, 1, 5)
    text = done.to_text()
    assert "10 rows; 4 already in the output; 2 run: 1 ok, 1 failed (404: 1)" in text
    assert "10 prompt + 5 completion tokens" in text


@pytest.mark.timeout(10)
def test_rows_collected_from_an_earlier_run_are_not_counted_as_generated_tokens():
    summary = BatchSummary(num_input_rows=3, num_already_done=0, num_enqueued=1)
    progress = Progress(summary, ProgressMode.NONE)
    progress.start()
    progress.row_done(200, 10, 5)
    progress.row_done(200, collected=True)
    progress.row_done(200, collected=True)
    done = progress.close()
    assert (done.num_run, done.num_collected, done.num_completion_tokens) == (3, 2, 5)
    assert "1 enqueued, 2 collected from earlier runs" in done.to_text()


@pytest.mark.timeout(10)
def test_chat_roles_are_openais_and_the_job_schemas():
    import typing

    from qworker.jobs.job import ChatRole
    from qworker.openai.rows import CHAT_ROLES, parse_messages

    assert typing.get_args(ChatRole) == CHAT_ROLES
    with pytest.raises(RowError, match=r"messages\[0\].role must be one of system, developer, user"):
        parse_messages([{"role": "wizard", "content": "hi"}])
    assert parse_messages([{"role": "developer", "content": "be brief"}])[0]["role"] == "developer"


@pytest.mark.timeout(10)
def test_max_tokens_0_with_echo_scores_the_prompt_and_returns_nothing_generated():
    body = {"model": "tiny", "prompt": "ab", "echo": True, "max_tokens": 0, "logprobs": 1}
    row = parse(body, COMPLETIONS)
    # The engine always generates a token; the response leaves it out.
    assert row.is_scoring_only and row.max_tokens == 1 and row.num_prompt_logprobs == 1
    output = Output(
        [7, 8],
        [Completion(0, "c", [9], "length", [{9: lp(-0.1, 1, "c")}])],
        prompt_logprobs=[None, {8: lp(-0.5, 1, "b")}],
    )
    text = response_body(row, Generation.from_request_output(output, with_prompt_logprobs=True), created=1)
    (choice,) = text.choices
    assert (choice.text, choice.finish_reason) == ("ab", "length")
    assert choice.logprobs.token_logprobs == [None, -0.5]
    assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (2, 0)
    # Without echo, or on chat, 0 stays a bad value.
    assert "max_tokens" in str(row_error({**body, "echo": False}, COMPLETIONS))
    assert "max_tokens" in str(row_error(chat_body(max_tokens=0)))
