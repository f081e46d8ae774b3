"""No single stream entry can stop a worker. Entries written straight into a Redis stream, as a
hostile producer would, served by a real `qworker worker --burst` subprocess on a tiny random
Llama: every entry ends with exactly one outcome (a result, or one dead letter with its reason),
the good jobs complete, nothing stays pending, and the worker exits 0.

The long fuzz with any seed is scripts/fuzz_stream.py.
"""

from __future__ import annotations

import json

import pytest

from qworker.backends.redis import keys as constants
from qworker.jobs.job import JobResult, JobStatus
from tests.integration.conftest import raw_redis, url_params

from .stream_fuzz import check_outcomes, generate, run_burst_worker, write_entries


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fuzzed_entries_each_get_one_outcome(url, tiny_model_dir, tmp_path):
    r = raw_redis(url)
    params = url_params(url)
    r.xgroup_create(params["stream"], params["group"], id="0", mkstream=True)
    entries = generate(num_batches=24, seed=None)  # derandomized: the same entries every run
    assert len(entries) >= 250
    message_ids = write_entries(r, params["stream"], entries)
    log_path = tmp_path / "worker.log"
    returncode = run_burst_worker(url, tiny_model_dir, log_path, timeout_s=150)
    log = log_path.read_text()
    assert returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    outcomes = check_outcomes(r, url, entries, message_ids)
    assert not outcomes.problems, outcomes.problems[:20]
    assert outcomes.num_results + outcomes.num_dead_lettered == len(entries)
    # The fuzz reached every exit: dead letters, validation failures, jobs run by the engine.
    assert outcomes.num_dead_lettered > 10 and outcomes.num_good_completed >= 24
    assert outcomes.num_completed - outcomes.num_good_completed > 20  # fuzzed jobs that ran
    assert outcomes.error_types["ValidationError"] > 10 and outcomes.error_types["InvalidJSON"] >= 3


@pytest.mark.timeout(120)
def test_the_entries_that_used_to_crash_workers(url, tiny_model_dir, tmp_path):
    r = raw_redis(url)
    params = url_params(url)
    stream, group, prefix = params["stream"], params["group"], params["prefix"]
    r.xgroup_create(stream, group, id="0", mkstream=True)

    def job(job_id: str, **job_params) -> dict[bytes, bytes]:
        body = {"prompt_token_ids": [1, 520, 3000], "params": {"max_tokens": 4, **job_params}}
        return {b"id": job_id.encode(), b"job": json.dumps(body).encode()}

    # A job that crashed every attempt so far: delivered three times by consumers that died.
    crashed = r.xadd(stream, job("crashed"))
    r.xreadgroup(group, "dead-worker", {stream: ">"}, count=1)  # delivery 1
    r.xclaim(stream, group, "dead-worker", 0, [crashed])  # 2
    r.xclaim(stream, group, "dead-worker", 0, [crashed], idle=10**9)  # 3, and its lease long expired
    r.set(constants.last_error_key(prefix, "crashed"), "attempt 3 (worker w9) ended without a result")
    # An id field that is not UTF-8, and the id field's name not UTF-8 (no id, no JSON body).
    bad_id = r.xadd(stream, {b"id": b"\xff\xfeid", b"job": b"{}"})
    bad_name = r.xadd(stream, {b"\xff\xfeid": b"x", b"job": b"\xff"})
    # Parameters that passed validation but crashed the step.
    r.xadd(stream, job("stop-ids", min_tokens=2, stop_token_ids=[999999]))
    r.xadd(stream, job("top-k", temperature=1, top_k=10**30))
    r.xadd(stream, job("seed", seed=10**30))
    r.xadd(stream, job("good", temperature=0, ignore_eos=True))

    log_path = tmp_path / "worker.log"
    returncode = run_burst_worker(url, tiny_model_dir, log_path, timeout_s=100)
    log = log_path.read_text()
    assert returncode == 0, log[-3000:]
    assert "Traceback" not in log

    def result(job_id: str) -> JobResult:
        raw = r.get(constants.result_key(prefix, job_id))
        assert raw is not None, job_id
        return JobResult.model_validate_json(raw)

    dead = {
        fields[b"message_id"].decode(): fields[b"reason"].decode()
        for _, fields in r.xrange(constants.dead_letter_stream(stream))
    }
    assert dead.keys() == {crashed.decode(), bad_id.decode(), bad_name.decode()}
    reason = "delivered 4 times; max_attempts is 3; last error: attempt 3 (worker w9) ended without a result"
    assert dead[crashed.decode()] == reason
    assert (result("crashed").error.type, result("crashed").error.message) == ("DeadLettered", reason)
    assert dead[bad_id.decode()] == "the entry's 'id' field is not UTF-8 text"
    assert "cannot read a job id" in dead[bad_name.decode()]
    assert result("stop-ids").error.type == "InvalidParamsError"
    assert "stop_token_ids [999999] is outside the vocabulary [0, 49152)" in result("stop-ids").error.message
    assert result("top-k").status is JobStatus.COMPLETED and len(result("top-k").token_ids) == 4
    assert result("seed").error.type == "ValidationError" and "seed must be" in result("seed").error.message
    assert result("good").status is JobStatus.COMPLETED and len(result("good").token_ids) == 4
    assert r.xpending(stream, group)["pending"] == 0 and r.xlen(stream) == 0
