"""Job decoding and the admission rule: no Redis, no model."""

from __future__ import annotations

import json

import pytest

from qworker.jobs.job import (
    MAX_JOB_BYTES,
    Job,
    JobDecodeError,
    JobResult,
    JobStatus,
    decode_job,
    derived_job_id,
    encode_job,
    resolve_job_id,
)
from qworker.worker.admission import AdmissionPolicy, HeldJobSize


def decode_error(body: bytes) -> JobDecodeError:
    with pytest.raises(JobDecodeError) as info:
        decode_job(body, "job-1")
    return info.value


@pytest.mark.timeout(10)
def test_valid_job_forms():
    job = decode_job(b'{"prompt": "hi", "params": {"max_tokens": 4, "temperature": 0}}', "job-1")
    assert job.id == "job-1" and job.params.max_tokens == 4 and job.params.is_greedy
    job = decode_job(b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"k": 1}}', "job-1")
    assert job.messages[0].content == "hi" and job.metadata == {"k": 1}
    job = decode_job(b'{"prompt_token_ids": [1, 2, 3], "timeout_s": 2.5, "ttl_s": 10}', "job-1")
    assert job.prompt_token_ids == [1, 2, 3] and job.timeout_s == 2.5
    adjusted = (
        b'{"prompt": "hi", "params": {"presence_penalty": 0.5, "frequency_penalty": -0.5, '
        b'"repetition_penalty": 1.2, "logit_bias": {"7": 100}, "allowed_token_ids": [7, 8], '
        b'"bad_words": ["x"], "truncate_prompt_tokens": 4}}'
    )
    params = decode_job(adjusted, "job-1").params
    assert params.logit_bias == {7: 100.0} and params.allowed_token_ids == [7, 8]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    # The JSON round trip keeps them (ids as string keys, as OpenAI's logit_bias has them).
    again = decode_job(encode_job(decode_job(adjusted, "job-1")), "job-1").params
    assert again == params


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("body", "error_type", "fragment"),
    [
        (b"\xff\x00not json", "InvalidJSON", "not valid JSON"),
        (b"[1, 2]", "ValidationError", "must be a JSON object"),
        (b'{"prompt": "a", "params": {"max_tokenz": 3}}', "ValidationError", "params.max_tokenz: unknown"),
        (b'{"prompt": "a", "colour": "red"}', "ValidationError", "colour: unknown field"),
        (b'{"prompt": "a", "params": {"max_tokens": 1000000000}}', "ValidationError", "must be at most"),
        (b'{"prompt": "a", "params": {"temperature": -1}}', "ValidationError", "temperature must be >= 0"),
        (b'{"messages": []}', "ValidationError", "messages is empty"),
        (b'{"prompt": ""}', "ValidationError", "prompt is empty"),
        (b"{}", "ValidationError", "exactly one of prompt, messages, prompt_token_ids"),
        (b'{"prompt": "a", "prompt_token_ids": [1]}', "ValidationError", "got prompt, prompt_token_ids"),
        (b'{"prompt": "a", "timeout_s": 0}', "ValidationError", "timeout_s"),
        (b'{"id": "other", "prompt": "a"}', "ValidationError", "differs from its envelope id"),
        # Strict JSON types: pydantic alone would take "10" and true as 10 and 1.
        (
            b'{"prompt": "a", "params": {"max_tokens": "10"}}',
            "ValidationError",
            "max_tokens must be an integer",
        ),
        (
            b'{"prompt": "a", "params": {"max_tokens": true}}',
            "ValidationError",
            "max_tokens must be an integer",
        ),
        (b'{"prompt": "a", "params": {"max_tokens": 1e308}}', "ValidationError", "an integer, got 1e+308"),
        (
            b'{"prompt": "a", "params": {"temperature": "0.5"}}',
            "ValidationError",
            "temperature must be a number",
        ),
        (
            b'{"prompt": "a", "params": {"ignore_eos": 1}}',
            "ValidationError",
            "ignore_eos must be true or false",
        ),
        (b'{"prompt": "a", "params": {"stop_token_ids": ["3"]}}', "ValidationError", "a list of integers"),
        (b'{"prompt": "a", "priority": "3"}', "ValidationError", "priority"),
        (
            b'{"prompt": "a", "params": {"presence_penalty": 2.5}}',
            "ValidationError",
            "presence_penalty must be in",
        ),
        (
            b'{"prompt": "a", "params": {"logit_bias": {"3": 101}}}',
            "ValidationError",
            "logit_bias[3] must be in",
        ),
        (b'{"prompt": "a", "params": {"allowed_token_ids": ["3"]}}', "ValidationError", "allowed_token_ids"),
        (b'{"prompt": "a", "timeout_s": "5"}', "ValidationError", "timeout_s"),
        (b'{"prompt_token_ids": [1, true]}', "ValidationError", "prompt_token_ids.1"),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "ValidationError", "messages.0.role"),
    ],
)
def test_bad_jobs_fail_with_clear_messages(body, error_type, fragment):
    error = decode_error(body)
    assert error.error_type == error_type
    assert fragment in error.message


@pytest.mark.timeout(10)
def test_oversized_body_is_rejected_before_parsing():
    body = json.dumps({"prompt": "x" * (10 * 2**20)}).encode()
    error = decode_error(body)
    assert error.error_type == "JobTooLarge" and "MiB" in error.message
    assert len(body) > MAX_JOB_BYTES


@pytest.mark.timeout(10)
def test_job_ids():
    assert resolve_job_id("env", b"garbage", "q", "1-0") == "env"
    assert resolve_job_id(None, b'{"id": "body-id", "prompt": "a"}', "q", "1-0") == "body-id"
    # A JSON job without an id gets one derived from the message: the same on every redelivery.
    derived = resolve_job_id(None, b'{"prompt": "a"}', "q", "1-0")
    assert derived == derived_job_id("q", "1-0") == resolve_job_id(None, b'{"prompt": "a"}', "q", "1-0")
    assert derived != derived_job_id("q", "2-0")
    assert resolve_job_id(None, b"\xff\xfe", "q", "1-0") is None
    assert resolve_job_id(None, b"[1]", "q", "1-0") is None
    assert Job(prompt="a").id != Job(prompt="a").id


@pytest.mark.timeout(10)
def test_result_round_trip():
    result = JobResult(id="a", status=JobStatus.TIMEOUT, text="partial", token_ids=[1, 2])
    assert JobResult.model_validate_json(result.model_dump_json()) == result
    assert json.loads(result.model_dump_json())["status"] == "timeout"


@pytest.mark.timeout(10)
def test_admission_rule():
    policy = AdmissionPolicy(block_size=16, max_backlog=4, reserve_blocks_per_seq=2, max_jobs_held=100)
    # Empty engine: bounded by the backlog.
    assert policy.decide(100, 100, []).num_jobs_to_pull == 4
    for _ in range(50):
        policy.observe_prompt(159)  # 10 blocks each
    running = HeldJobSize(num_prompt_tokens=159, max_tokens=100, num_output_tokens=1, is_started=True)
    waiting = HeldJobSize(num_prompt_tokens=159, max_tokens=100, num_output_tokens=0, is_started=False)
    decision = policy.decide(100, 40, [running, running, waiting])
    assert decision.num_reserved_blocks == 4  # 2 running x min(2, blocks still needed)
    assert decision.num_committed_blocks == 10
    assert decision.num_headroom_blocks == 26
    assert decision.num_jobs_to_pull == 2  # 26 // ~10 blocks
    # A running job about to finish needs no reserve.
    finishing = HeldJobSize(num_prompt_tokens=159, max_tokens=1, num_output_tokens=1, is_started=True)
    assert policy.decide(100, 40, [finishing]).num_reserved_blocks == 0
    # No headroom: nothing is pulled, whatever the backlog.
    assert policy.decide(100, 12, [running, waiting]).num_jobs_to_pull == 0
    # A full backlog stops pulls even with free blocks.
    assert policy.decide(1000, 1000, [waiting] * 4).num_jobs_to_pull == 0


@pytest.mark.timeout(10)
def test_exported_schemas_are_current():
    from pathlib import Path

    from qworker.jobs.json_schema import render, schemas

    docs = Path(__file__).resolve().parents[2] / "docs"
    for name, schema in schemas().items():
        current = (docs / name).read_text()
        assert current == render(schema), f"stale {name}: run python -m qworker.jobs.json_schema docs"
