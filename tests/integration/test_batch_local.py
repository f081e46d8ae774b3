"""`qworker batch` in local mode on a tiny random Llama with the SmolLM2 tokenizer: 200 mixed rows
give LLM.generate's greedy texts; rows are read as the engine frees room; a SIGKILLed run is
completed by a rerun that runs only the missing rows; bad files fail whole and write nothing;
bad rows get 4xx lines while the others run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from typer.testing import CliRunner

from qworker import cli
from qworker.batch.local import LocalRunner
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.openai.batches.files import InputRow
from qworker.openai.batches.output import BatchOutput, OutputFile
from qworker.openai.batches.progress import BatchSummary, Progress, ProgressMode
from qworker.openai.rows import prepare_rows
from tests.integration.batch_support import (
    CHAT_URL,
    COMPLETIONS_URL,
    ENGINE_ARGS,
    MODEL_NAME,
    assert_matches_reference,
    batch_command,
    batch_row,
    engine_flags,
    mixed_rows,
    read_output,
    reference_outputs,
    subprocess_env,
    write_batch_model_dir,
    write_jsonl,
)

ROWS = mixed_rows(200)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_batch_model_dir(tmp_path_factory.mktemp("batch-model"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_outputs(model_dir, ROWS)


def invoke(model_dir, tmp_path, *args: str, **engine_overrides):
    """`qworker batch` in this process; its own work dir, so nothing lands in ~/.cache."""
    flags = [*args, "--served-model-name", MODEL_NAME, "--work-dir", str(tmp_path / "work")]
    return CliRunner().invoke(cli.app, ["batch", *flags, *engine_flags(model_dir, **engine_overrides)])


@pytest.mark.timeout(120)
def test_200_mixed_rows_give_llm_generate_texts_and_a_rerun_runs_nothing(model_dir, reference, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    result = invoke(model_dir, tmp_path, "-i", str(source), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "200 rows; 0 already in the output; 200 run: 200 ok, 0 failed" in result.stderr
    lines = read_output(out)
    assert len(lines) == 200
    assert_matches_reference(lines, ROWS, reference)
    # Each line's usage says what its prompt found in the prefix cache: whole 16-token blocks of
    # its prompt; the chat rows share their template's opening, so some find it.
    usages = [line.response.body.usage for line in lines]  # type: ignore[union-attr]
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert all(0 <= c < u.prompt_tokens and c % 16 == 0 for c, u in zip(cached, usages, strict=True))
    assert sum(1 for c in cached if c > 0) > 10, cached
    first = out.read_bytes()
    again = invoke(model_dir, tmp_path, "-i", str(source), "-o", str(out))
    assert again.exit_code == 0, again.output
    assert "200 already in the output; 0 run" in again.stderr
    assert out.read_bytes() == first


@pytest.mark.timeout(120)
def test_rows_are_read_as_the_engine_frees_room(model_dir, reference, tmp_path):
    rows = ROWS[:60]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_num_seqs=4, **ENGINE_ARGS))
    output = BatchOutput(OutputFile(_location(tmp_path / "out.jsonl"), tmp_path), None)
    output.load(resume=True)
    output.open()
    num_read = 0
    ahead = []  # rows read but not yet written, at each write

    def counted():
        nonlocal num_read
        for row in _input_rows(source):
            num_read += 1
            yield row

    write = output.write
    output.write = lambda line: (ahead.append(num_read - output.output.num_lines_written), write(line))
    progress = Progress(BatchSummary(len(rows), 0), ProgressMode.NONE)
    runner = LocalRunner(engine, output, progress)
    runner.run(prepare_rows(counted(), batch_id="b", served_model_names=[MODEL_NAME]))
    output.close()
    assert runner.max_in_flight == 8 and runner.max_rows_held == 8
    assert max(ahead) <= 8, "never more rows read than written plus twice max_num_seqs"
    assert_matches_reference(read_output(tmp_path / "out.jsonl"), rows, reference)


def _location(path):
    from qworker.openai.batches.files import Location

    return Location(str(path), path=path)


def _input_rows(path):
    for i, line in enumerate(path.read_text().splitlines(), 1):
        data = json.loads(line)
        yield InputRow(i, data["custom_id"], data["url"], data["body"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sigkilled_run_is_completed_by_a_rerun_that_runs_only_the_missing_rows(
    model_dir, reference, tmp_path
):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    args = ["-i", str(source), "-o", str(out), "--served-model-name", MODEL_NAME, "--work-dir", str(tmp_path)]
    # Two rows at a time: the run lasts long enough to be killed in the middle.
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        batch_command(*args, *engine_flags(model_dir, max_num_seqs=2)),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=subprocess_env(),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 40):
        assert process.poll() is None, (tmp_path / "first.log").read_text()
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    log.close()
    # The kill may cut a line in two; make sure the rerun meets one.
    with open(out, "a") as f:
        f.write('{"id": "batch_req_x", "custom_id": "row-1')
    num_kept = sum(1 for line in out.read_text().splitlines() if line.endswith("}"))
    assert 40 <= num_kept < 200, f"the first run must be killed midway ({num_kept} lines)"
    rerun = invoke(model_dir, tmp_path, "-i", str(source), "-o", str(out))
    assert rerun.exit_code == 0, rerun.output
    num_run = 200 - num_kept
    assert f"{num_kept} already in the output; {num_run} run: {num_run} ok" in rerun.stderr
    lines = read_output(out)
    assert len(lines) == 200
    assert_matches_reference(lines, ROWS, reference)


WHOLE_FILE_CASES = {
    "not-json": (['{"custom_id": "x", "method": "POST",'], "line 2: not JSON"),
    "no-custom-id": ([json.dumps({"method": "POST", "url": CHAT_URL, "body": {}})], "line 2: no custom_id"),
    "duplicate": ([json.dumps(batch_row("row-0", CHAT_URL, {}))], "line 2: custom_id 'row-0' repeats line 1"),
    "method": (
        [json.dumps({"custom_id": "g", "method": "GET", "url": CHAT_URL, "body": {}})],
        "line 2: method must be POST, got 'GET'",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(WHOLE_FILE_CASES))
def test_a_bad_file_fails_whole_with_exit_code_2_and_writes_nothing(model_dir, tmp_path, case):
    bad_lines, message = WHOLE_FILE_CASES[case]
    source = write_jsonl(tmp_path / "in.jsonl", [ROWS[0], *bad_lines, ROWS[1]])
    out = tmp_path / "out.jsonl"
    result = invoke(
        model_dir, tmp_path, "-i", str(source), "-o", str(out), "--errors", str(tmp_path / "e.jsonl")
    )
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "nothing was run" in result.stderr
    assert not out.exists() and not (tmp_path / "e.jsonl").exists()
    # An output from an earlier run stays as it was.
    out.write_text("earlier\n")
    assert invoke(model_dir, tmp_path, "-i", str(source), "-o", str(out)).exit_code == 2
    assert out.read_text() == "earlier\n"


def bad_row(custom_id: str, url: str = CHAT_URL, **body) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **body}
    return batch_row(custom_id, url, body)


@pytest.mark.timeout(120)
def test_bad_rows_get_4xx_lines_and_the_others_run(model_dir, reference, tmp_path):
    bad = {
        "unknown-model": (bad_row("unknown-model", model="gpt-4"), 404, "model_not_found"),
        # /v1/embeddings rows run (docs/pooling.md); a url qworker has no door for does not.
        "embeddings": (bad_row("embeddings", "/v1/moderations"), 400, "invalid_url"),
        "stream": (bad_row("stream", stream=True), 400, "invalid_request_error"),
        "temperature": (bad_row("temperature", temperature=-1), 400, "invalid_request_error"),
        "n": (bad_row("n", n=0), 400, "invalid_request_error"),
        "logprobs": (bad_row("logprobs", logprobs=True, top_logprobs=21), 400, "invalid_request_error"),
        "top-logprobs-alone": (bad_row("top-logprobs-alone", top_logprobs=2), 400, "invalid_request_error"),
        "too-long": (
            batch_row("too-long", COMPLETIONS_URL, {"prompt": [40] * 1100, "max_tokens": 2}),
            400,
            "context_length_exceeded",
        ),
        "roles": (
            bad_row(
                "roles",
                messages=[{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
            ),
            None,
            None,
        ),
    }
    good = ROWS[:30]
    rows = [*good[:10], *(case[0] for case in bad.values()), *good[10:]]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    result = invoke(model_dir, tmp_path, "-i", str(source), "-o", str(out), "--errors", str(errors))
    assert result.exit_code == 0, result.output
    failed = {line.custom_id: line for line in read_output(errors)}
    # A conversation the chat template refuses fails with a 400; one it accepts runs. No crash.
    ran = [line for line in read_output(out) if line.custom_id != "roles"]
    assert len(ran) + len(failed) == len(rows) - ("roles" not in failed)
    assert_matches_reference(ran, good, reference)
    assert set(failed) - {"roles"} == set(bad) - {"roles"}
    if "roles" in failed:
        assert failed["roles"].response.status_code == 400
    for custom_id, (_row, status, code) in bad.items():
        if status is None:
            continue
        line = failed[custom_id]
        assert line.response.status_code == status and line.error.code == code, line
        assert line.response.body.error.message == line.error.message
    assert "n must be an integer" in failed["n"].error.message
    assert "1100 tokens" in failed["too-long"].error.message
    # Without --errors, the same lines go to the output, with `error` set.
    single = tmp_path / "single.jsonl"
    assert invoke(model_dir, tmp_path, "-i", str(source), "-o", str(single)).exit_code == 0
    lines = read_output(single)
    assert len(lines) == len(rows)
    assert {line.custom_id for line in lines if line.is_error} == set(failed)
    assert all(line.error is not None for line in lines if line.is_error)


@pytest.mark.timeout(60)
def test_an_empty_file_gives_an_empty_output(model_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n\n")
    out = tmp_path / "out.jsonl"
    result = invoke(model_dir, tmp_path, "-i", str(source), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert out.exists() and out.read_text() == ""
    assert "0 rows" in result.stderr


@pytest.mark.timeout(120)
def test_no_resume_starts_the_output_over(model_dir, reference, tmp_path):
    rows = ROWS[:12]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    for _ in range(2):
        result = invoke(model_dir, tmp_path, "-i", str(source), "-o", str(out), "--no-resume")
        assert result.exit_code == 0, result.output
        assert "0 already in the output; 12 run" in result.stderr
    assert_matches_reference(read_output(out), rows, reference)
