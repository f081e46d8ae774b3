"""`qworker batch` with its input, output and errors files on S3 (moto's server mode on loopback,
boto3 over HTTP): the output object holds one line per row, a rerun resumes from it, an
interrupted run resumes from its local staging file, and a bad or missing input writes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest
from typer.testing import CliRunner

from qworker import cli
from qworker.openai.format import BatchOutputLine
from tests.integration.batch_support import (
    CHAT_URL,
    MODEL_NAME,
    assert_matches_reference,
    batch_command,
    batch_row,
    engine_flags,
    mixed_rows,
    reference_outputs,
    subprocess_env,
    write_batch_model_dir,
)

ROWS = mixed_rows(40, seed=3)
BAD_ROWS = [
    batch_row("bad-model", CHAT_URL, {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
    batch_row("bad-url", "/v1/moderations", {"model": MODEL_NAME, "input": "x"}),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_batch_model_dir(tmp_path_factory.mktemp("batch-model"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_outputs(model_dir, ROWS)


class Bucket:
    def __init__(self, moto):
        self.moto = moto
        self.name = f"qw-batch-{uuid.uuid4().hex[:10]}"
        self.s3 = moto.client("s3")
        self.s3.create_bucket(Bucket=self.name)

    def url(self, key: str) -> str:
        return f"s3://{self.name}/{key}?{self.moto.query}"

    def put_lines(self, key: str, rows) -> None:
        import json

        body = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
        self.s3.put_object(Bucket=self.name, Key=key, Body=body.encode())

    def read(self, key: str) -> bytes | None:
        try:
            return self.s3.get_object(Bucket=self.name, Key=key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None

    def lines(self, key: str) -> list[BatchOutputLine]:
        data = self.read(key)
        assert data is not None, f"no object {key}"
        return [BatchOutputLine.model_validate_json(line) for line in data.decode().splitlines()]


@pytest.fixture
def bucket(moto_server):
    return Bucket(moto_server)


def invoke(model_dir, tmp_path, *args: str):
    flags = ["--served-model-name", MODEL_NAME, "--work-dir", str(tmp_path / "work")]
    return CliRunner().invoke(cli.app, ["batch", *args, *flags, *engine_flags(model_dir)])


@pytest.mark.timeout(120)
def test_input_output_and_errors_on_s3_and_a_rerun_resumes_from_the_object(
    model_dir, reference, bucket, tmp_path
):
    bucket.put_lines("in/batch.jsonl", [*ROWS[:20], *BAD_ROWS, *ROWS[20:]])
    args = [
        "-i",
        bucket.url("in/batch.jsonl"),
        "-o",
        bucket.url("out/results.jsonl"),
        "--errors",
        bucket.url("out/errors.jsonl"),
    ]
    result = invoke(model_dir, tmp_path, *args)
    assert result.exit_code == 0, result.output
    assert "42 rows; 0 already in the output; 42 run: 40 ok, 2 failed (400: 1, 404: 1)" in result.stderr
    assert_matches_reference(bucket.lines("out/results.jsonl"), ROWS, reference)
    errors = {line.custom_id: line.response.status_code for line in bucket.lines("out/errors.jsonl")}
    assert errors == {"bad-model": 404, "bad-url": 400}
    assert not list((tmp_path / "work").glob("*staging*")), "staging files go once uploaded"
    before = bucket.read("out/results.jsonl")
    again = invoke(model_dir, tmp_path, *args)
    assert again.exit_code == 0, again.output
    assert "42 already in the output; 0 run" in again.stderr
    assert bucket.read("out/results.jsonl") == before


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_interrupted_run_with_an_s3_output_resumes_from_its_staging_file(
    model_dir, reference, bucket, moto_server, tmp_path
):
    bucket.put_lines("in.jsonl", ROWS)
    out_key = "out.jsonl"
    args = ["-i", bucket.url("in.jsonl"), "-o", bucket.url(out_key)]
    work = tmp_path / "work"
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115 - closed below
    flags = ["--served-model-name", MODEL_NAME, "--work-dir", str(work)]
    process = subprocess.Popen(
        batch_command(*args, *flags, *engine_flags(model_dir, max_num_seqs=1)),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=subprocess_env(),
    )
    deadline = time.monotonic() + 120

    def staged_lines() -> int:
        staged = list(work.glob("*staging*"))
        return staged[0].read_text().count("\n") if staged else 0

    while time.monotonic() < deadline and staged_lines() < 10:
        assert process.poll() is None, (tmp_path / "first.log").read_text()
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    log.close()
    num_staged = staged_lines()
    assert 10 <= num_staged < len(ROWS), f"killed midway ({num_staged} lines)"
    assert bucket.read(out_key) is None, "nothing is uploaded before the batch is done"
    rerun = invoke(model_dir, tmp_path, *args)
    assert rerun.exit_code == 0, rerun.output
    assert f"{num_staged} already in the output; {len(ROWS) - num_staged} run" in rerun.stderr
    assert_matches_reference(bucket.lines(out_key), ROWS, reference)


@pytest.mark.timeout(60)
def test_a_bad_or_missing_input_on_s3_writes_nothing(model_dir, bucket, tmp_path):
    bucket.put_lines("bad.jsonl", [ROWS[0], ROWS[0]])
    bad = invoke(model_dir, tmp_path, "-i", bucket.url("bad.jsonl"), "-o", bucket.url("out.jsonl"))
    assert bad.exit_code == 2, bad.output
    assert "line 2: custom_id 'row-0' repeats line 1" in bad.stderr
    missing = invoke(model_dir, tmp_path, "-i", bucket.url("nope.jsonl"), "-o", bucket.url("out.jsonl"))
    assert missing.exit_code == 2, missing.output
    assert "does not exist" in missing.stderr
    assert bucket.read("out.jsonl") is None
    unknown = invoke(model_dir, tmp_path, "-i", bucket.url("bad.jsonl") + "&colour=red", "-o", "x.jsonl")
    assert unknown.exit_code == 2 and "colour" in unknown.stderr
