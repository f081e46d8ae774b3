"""`qworker submit` and `qworker batch` end a user's mistake with one `qworker: error:` line and a
documented exit code, never a traceback (the traceback is for --log-level DEBUG)."""

from __future__ import annotations

import uuid

import pytest
from typer.testing import CliRunner

from qworker import cli, cli_errors
from qworker.testing.worker_kit import redis_base_url


@pytest.fixture(scope="module")
def queue_url():
    return f"{redis_base_url()}?stream=qwtest:submit:{uuid.uuid4().hex[:8]}"


def submit(queue_url: str, *args: str):
    return CliRunner().invoke(cli.app, ["submit", "--queue", queue_url, *args])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-tokens", "-5", "hi"], "params: max_tokens must be at least 1, got -5"),
        (["--temperature", "nan", "hi"], "params: temperature must be a finite number, got nan"),
        (["--raw", ""], "job: prompt is empty"),
        (["--affinity", "k" * 257, "hi"], "affinity: affinity is 257 bytes of UTF-8; the limit is 256"),
        (["--lora", "", "hi"], "lora: String should have at least 1 character"),
        (["--param", "presence_penalty=3", "hi"], "params: presence_penalty must be in [-2, 2], got 3.0"),
        (
            ["--param", 'logit_bias={"5": 101}', "hi"],
            "params: logit_bias[5] must be in [-100, 100], got 101.0",
        ),
    ],
)
def test_an_invalid_job_is_one_line_and_exit_2(queue_url, args, message):
    result = submit(queue_url, *args)
    assert result.exit_code == cli_errors.EXIT_USAGE, result.output
    assert result.stderr.strip() == f"qworker: error: invalid job: {message}"
    assert "Traceback" not in result.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
def test_no_result_within_the_timeout_is_one_line_and_exit_6(queue_url, stream):
    result = submit(queue_url, "--timeout", "0.3", *(["--stream"] if stream else []), "hi")
    assert result.exit_code == cli_errors.EXIT_WAIT_TIMEOUT, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("qworker: error: ") and "0.3" in last, result.stderr
    assert "Traceback" not in result.output


@pytest.mark.timeout(60)
def test_batch_errors_use_the_same_prefix(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("{oops\n")
    result = CliRunner().invoke(cli.app, ["batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("qworker: error: ") and "line 1: not JSON" in result.stderr
