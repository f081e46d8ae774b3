"""`qworker batch --queue` across a pool of `qworker worker` processes on the real Redis: 200 mixed
rows give LLM.generate's greedy texts; the runner and a worker SIGKILLed midway lose nothing, a
rerun enqueues nothing twice and no row runs to completion twice; a bad file enqueues nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis as redis_lib
from typer.testing import CliRunner

from qworker import cli
from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, open_sink, parse_url
from qworker.openai.batches.files import parse_location
from qworker.openai.batches.validate import check_input
from qworker.openai.rows import request_id_for
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url
from tests.integration.batch_support import (
    MODEL_NAME,
    assert_matches_reference,
    batch_command,
    mixed_rows,
    read_output,
    reference_outputs,
    subprocess_env,
    write_batch_model_dir,
    write_jsonl,
)

ROWS = mixed_rows(200)
WORKER_ARGS = ("--num-kv-blocks", "512", "--block-size", "16")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_batch_model_dir(tmp_path_factory.mktemp("batch-model"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return reference_outputs(model_dir, ROWS)


@pytest.fixture(scope="module")
def pool_url():
    url = unique_url(redis_base_url(), tag="batch")
    yield url
    cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)


@pytest.fixture(scope="module")
def pool(pool_url, model_dir, tmp_path_factory):
    """Two workers on one queue for the module. Four rows at a time each and short leases: a run
    lasts long enough to be killed midway, and a killed worker's jobs go to its peer soon after.
    The SIGKILL test kills one of them, so it runs last."""
    logs = tmp_path_factory.mktemp("pool-logs")
    workers = start_workers(
        pool_url, model_dir, logs, ["w1", "w2"], "--max-num-seqs", "4", "--lease-timeout-s", "2"
    )
    yield dict(zip(["w1", "w2"], workers, strict=True)), logs
    stop(workers)


@pytest.fixture
def url():
    url = unique_url(redis_base_url(), tag="batch-bad")
    yield url
    cleanup(redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url), url)


def stream_of(url: str) -> tuple[redis_lib.Redis, str]:
    parsed = parse_url(url, SOURCE_PARAMS | SINK_PARAMS)
    return redis_lib.Redis.from_url(parsed.connection_url), parsed.params["stream"]


def entries_added(url: str) -> int:
    """Messages ever put on the queue's stream (acked ones are deleted, so not XLEN)."""
    redis, stream = stream_of(url)
    if not redis.exists(stream):
        return 0
    return int(redis.xinfo_stream(stream)["entries-added"])


def start_workers(url, model_dir, tmp_path, names, *extra):
    """Start the workers side by side (each takes seconds to load) and wait for all of them."""
    with ThreadPoolExecutor(len(names)) as pool:
        futures = [
            pool.submit(
                spawn_worker, url, model_dir, name, *WORKER_ARGS, *extra, log_path=tmp_path / f"{name}.log"
            )
            for name in names
        ]
        return [f.result() for f in futures]


def stop(processes):
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def invoke(url, tmp_path, *args):
    flags = ["--queue", url, "--served-model-name", MODEL_NAME, "--work-dir", str(tmp_path / "work")]
    return CliRunner().invoke(cli.app, ["batch", *args, *flags])


def batch_id_of(path) -> str:
    return check_input(parse_location(str(path))).content_hash[:24]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_200_mixed_rows_across_two_workers_give_llm_generate_texts(
    model_dir, reference, pool, pool_url, tmp_path
):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    num_enqueued_before = entries_added(pool_url)
    result = invoke(pool_url, tmp_path, "-i", str(source), "-o", str(out), "--batch-id", "whole")
    assert result.exit_code == 0, result.output
    assert "200 run: 200 ok, 0 failed; 200 enqueued" in result.stderr
    lines = read_output(out)
    assert len(lines) == 200
    assert_matches_reference(lines, ROWS, reference)
    # Across the pool: both workers ran rows, and each row ran once.
    sink = open_sink(pool_url)
    results = [sink.get_result(request_id_for("whole", row["custom_id"])) for row in ROWS]
    assert {r.worker for r in results} == {"w1", "w2"}
    assert {r.attempts for r in results} == {1}
    assert entries_added(pool_url) - num_enqueued_before == 200
    assert not list((tmp_path / "work").glob("*.submitted")), "the journal of sent rows goes with the batch"
    # The same batch into a new output file (so with no journal): every row is collected from the
    # store and none goes on the queue again, where it would count toward the autoscaler's depth.
    again = tmp_path / "again.jsonl"
    rerun = invoke(pool_url, tmp_path, "-i", str(source), "-o", str(again), "--batch-id", "whole")
    assert rerun.exit_code == 0, rerun.output
    assert "200 run: 200 ok, 0 failed; 0 enqueued, 200 collected from earlier runs" in rerun.stderr
    assert "0 completion tokens generated" in rerun.stderr
    assert entries_added(pool_url) - num_enqueued_before == 200
    assert_matches_reference(read_output(again), ROWS, reference)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_runner_and_a_worker_sigkilled_midway_then_a_rerun_completes_the_file(
    model_dir, reference, pool, pool_url, tmp_path
):
    workers, logs = pool
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    num_enqueued_before = entries_added(pool_url)
    args = ["-i", str(source), "-o", str(out), "--batch-id", "killed"]
    flags = ["--queue", pool_url, "--served-model-name", MODEL_NAME, "--work-dir", str(tmp_path / "work")]
    log = open(tmp_path / "runner.log", "w")  # noqa: SIM115 - closed below
    runner = subprocess.Popen(
        batch_command(*args, *flags), stdout=log, stderr=subprocess.STDOUT, env=subprocess_env()
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 30):
        assert runner.poll() is None, (tmp_path / "runner.log").read_text()
        time.sleep(0.01)
    os.kill(runner.pid, signal.SIGKILL)
    os.kill(workers["w1"].pid, signal.SIGKILL)
    runner.wait(10)
    workers["w1"].wait(10)
    log.close()
    num_written = out.read_text().count("\n")
    assert 30 <= num_written < 200, f"the runner must die midway ({num_written} lines)"
    num_enqueued_by_first = entries_added(pool_url) - num_enqueued_before
    rerun = invoke(pool_url, tmp_path, *args)
    assert rerun.exit_code == 0, rerun.output
    lines = read_output(out)
    assert len(lines) == 200
    assert_matches_reference(lines, ROWS, reference)
    # Nothing enqueued twice: the rerun sent only rows the killed runner had not sent.
    assert entries_added(pool_url) - num_enqueued_before == 200
    assert f"{200 - num_enqueued_by_first} enqueued" in rerun.stderr
    # No row ran to completion twice: a second completion would find the first result stored.
    for name in ("w1", "w2"):
        assert "already had a result" not in (logs / f"{name}.log").read_text()
    # The killed worker held jobs; its peer took them over after their leases ran out.
    sink = open_sink(pool_url)
    results = [sink.get_result(request_id_for("killed", row["custom_id"])) for row in ROWS]
    assert any(r.attempts > 1 and r.worker == "w2" for r in results)


@pytest.mark.timeout(60)
def test_a_bad_file_enqueues_nothing(url, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [*ROWS[:5], "{oops", *ROWS[5:10]])
    out = tmp_path / "out.jsonl"
    result = invoke(url, tmp_path, "-i", str(source), "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "line 6: not JSON" in result.stderr
    assert not out.exists()
    assert entries_added(url) == 0
