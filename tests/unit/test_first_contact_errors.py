"""The errors a user meets first are one clear line and an exit code, not a traceback: an
unreachable Redis, a typo in a URL's query, no AWS credentials, an unknown model. `qworker worker`
runs in a subprocess, as a user runs it; nothing here loads a model or needs a server.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer

from qworker.cli_errors import EXIT_ENGINE_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, reported_errors
from qworker.errors import EngineFailedError

pytestmark = pytest.mark.timeout(60)

# With no credentials anywhere in boto3's chain: the environment, the shared files, the instance
# role (the metadata service is not asked, so the check is quick off EC2 too).
NO_AWS = {
    "AWS_ACCESS_KEY_ID": "",
    "AWS_SECRET_ACCESS_KEY": "",
    "AWS_SESSION_TOKEN": "",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
    "AWS_CONFIG_FILE": "/nonexistent/config",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def run_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("AWS_") and not k.startswith("QWORKER_")
    }
    environ.update(OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "qworker", "worker", "--model", "/nonexistent/model", *args],
        capture_output=True,
        text=True,
        timeout=50,
        env=environ,
    )


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The error line on stderr, after checking that it is the only error output."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("qworker: error: ")]
    assert len(errors) == 1, proc.stderr
    # Nothing else but ordinary log lines (timestamped) around it.
    others = [line for line in proc.stderr.splitlines() if line not in errors and line.strip()]
    assert all(" INFO " in line or " WARNING " in line for line in others), proc.stderr
    return errors[0]


def test_unreachable_redis_is_one_line_naming_the_url_and_what_was_tried():
    proc = run_worker("--queue", "redis://:hunter2@127.0.0.1:1/0?stream=jobs")
    assert proc.returncode == EXIT_UNREACHABLE, proc.stderr
    line = one_line_error(proc)
    assert "cannot connect to the queue at redis://:***@127.0.0.1:1/0?stream=jobs" in line
    assert "connecting to 127.0.0.1:1" in line and "refused" in line
    assert "hunter2" not in proc.stderr + proc.stdout


def test_unknown_url_parameter_is_named_with_the_accepted_ones():
    proc = run_worker("--queue", "redis://127.0.0.1:1/0?steam=jobs")
    assert proc.returncode == EXIT_USAGE, proc.stderr
    line = one_line_error(proc)
    assert "unknown URL parameter 'steam'" in line
    assert "Accepted (qworker's: " in line and "stream" in line


def test_missing_aws_credentials_say_where_boto3_looked():
    proc = run_worker(
        "--queue",
        "sqs://jobs?region=us-east-1&endpoint_url=http://127.0.0.1:1",
        "--results",
        "redis://127.0.0.1:1/0",
        env=NO_AWS,
    )
    assert proc.returncode == EXIT_UNREACHABLE, proc.stderr
    line = one_line_error(proc)
    assert "cannot connect to the queue at sqs://jobs?" in line
    assert "no AWS credentials found" in line and "AWS_ACCESS_KEY_ID" in line


def test_debug_log_level_shows_the_traceback():
    proc = run_worker("--queue", "redis://127.0.0.1:1/0?stream=jobs", "--log-level", "DEBUG")
    assert proc.returncode == EXIT_UNREACHABLE
    assert "Traceback" in proc.stderr
    assert "redis.exceptions.ConnectionError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("qworker: error: cannot connect to the queue")


def test_unknown_model_is_one_line():
    # A reachable queue (the embedded one is not needed: a memory queue), then the model.
    proc = run_worker("--queue", "memory://jobs")
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "unknown model '/nonexistent/model'" in one_line_error(proc)


def test_a_broken_engine_exits_with_its_own_code(capsys):
    with pytest.raises(typer.Exit) as info, reported_errors():
        raise EngineFailedError("worker w stopped: its engine failed 3 steps in a row: boom", 3)
    assert info.value.exit_code == EXIT_ENGINE_FAILED
    assert (
        capsys.readouterr().err
        == "qworker: error: worker w stopped: its engine failed 3 steps in a row: boom\n"
    )
    # Anything unforeseen keeps its traceback (exit 1).
    with pytest.raises(ZeroDivisionError), reported_errors():
        raise ZeroDivisionError


# -- engine options this machine or model cannot honour: one line at start, exit 2 -------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from qworker.testing.worker_kit import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda"], "device 'cuda': torch finds no CUDA device here"),
        (["--device", "tpu"], "device 'tpu' is not a device name; use auto, cpu or cuda"),
        (["--device", "meta"], "device 'meta' is not supported; use auto, cpu or cuda"),
        (
            ["--attention-backend", "triton"],
            "attention_backend 'triton' needs a CUDA device; this engine runs on cpu",
        ),
        (["--max-model-len", "999999"], "max_model_len 999999 exceeds the model's"),
        (["--kv-cache-memory-bytes", str(2**50)], "GiB) is more than this machine has available"),
    ],
)
def test_an_engine_option_the_machine_cannot_honour_is_one_line_and_exit_2(
    tiny_model, monkeypatch, args, message
):
    from typer.testing import CliRunner

    from qworker.cli import app

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if args[0] == "--device" and args[1] == "cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
    result = CliRunner().invoke(
        app, ["worker", "--queue", "memory://bad-options", "--burst", "--model", str(tiny_model), *args]
    )
    assert result.exit_code == EXIT_USAGE, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("qworker: error: ")]
    assert len(errors) == 1 and message in errors[0], result.output
