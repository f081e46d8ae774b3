"""No single stream entry can stop a worker. Entries written straight into a Redis stream, as a
hostile producer would, served by a real `qworker worker --burst` subprocess on a tiny random
Llama: every entry ends with exactly one outcome (a result, or one dead letter with its reason),
the good jobs complete, nothing stays pending, and the worker exits 0.

Both tests' entries share one stream and one worker run (a worker start is most of the cost): the
entries that used to crash workers come first, then the fuzzed ones; each test checks its own.

The long fuzz with any seed is scripts/fuzz_stream.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from qworker.backends.redis import keys as constants
from qworker.jobs.job import JobResult, JobStatus
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from tests.integration.conftest import raw_redis, url_params

from .stream_fuzz import Entry, check_outcomes, generate, run_burst_worker, write_entries


@dataclass
class Served:
    """The stream after one burst worker ran on both tests' entries."""

    r: Any
    url: str
    fuzzed: list[Entry]
    fuzzed_message_ids: list[str]
    # The message ids of the entries that used to crash workers, by name.
    crashers: dict[str, str]
    returncode: int
    log: str


def write_crashers(r: Any, stream: str, group: str, prefix: str) -> dict[str, str]:
    def job(job_id: str, **job_params) -> dict[bytes, bytes]:
        body = {"prompt_token_ids": [1, 520, 3000], "params": {"max_tokens": 4, **job_params}}
        return {b"id": job_id.encode(), b"job": json.dumps(body).encode()}

    # A job that crashed every attempt so far: delivered three times by consumers that died. (The
    # stream's first entry, so that the read below delivers it.)
    crashed = r.xadd(stream, job("crashed"))
    r.xreadgroup(group, "dead-worker", {stream: ">"}, count=1)  # delivery 1
    r.xclaim(stream, group, "dead-worker", 0, [crashed])  # 2
    r.xclaim(stream, group, "dead-worker", 0, [crashed], idle=10**9)  # 3, and its lease long expired
    r.set(constants.last_error_key(prefix, "crashed"), "attempt 3 (worker w9) ended without a result")
    ids = {"crashed": crashed}
    # An id field that is not UTF-8, and the id field's name not UTF-8 (no id, no JSON body).
    ids["bad_id"] = r.xadd(stream, {b"id": b"\xff\xfeid", b"job": b"{}"})
    ids["bad_name"] = r.xadd(stream, {b"\xff\xfeid": b"x", b"job": b"\xff"})
    # Parameters that passed validation but crashed the step.
    ids["stop-ids"] = r.xadd(stream, job("stop-ids", min_tokens=2, stop_token_ids=[999999]))
    ids["top-k"] = r.xadd(stream, job("top-k", temperature=1, top_k=10**30))
    ids["seed"] = r.xadd(stream, job("seed", seed=10**30))
    ids["good"] = r.xadd(stream, job("good", temperature=0, ignore_eos=True))
    return {name: message_id.decode() for name, message_id in ids.items()}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    url = unique_url(redis_base_url(), tag="poison_entries")
    r = raw_redis(url)
    try:
        params = url_params(url)
        stream, group, prefix = params["stream"], params["group"], params["prefix"]
        r.xgroup_create(stream, group, id="0", mkstream=True)
        crashers = write_crashers(r, stream, group, prefix)
        fuzzed = generate(num_batches=24, seed=None)  # derandomized: the same entries every run
        fuzzed_message_ids = write_entries(r, stream, fuzzed)
        log_path = tmp_path_factory.mktemp("poison") / "worker.log"
        returncode = run_burst_worker(url, tiny_model_dir, log_path, timeout_s=150)
        yield Served(r, url, fuzzed, fuzzed_message_ids, crashers, returncode, log_path.read_text())
    finally:
        cleanup(r, url)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fuzzed_entries_each_get_one_outcome(served):
    entries = served.fuzzed
    assert len(entries) >= 250
    assert served.returncode == 0, served.log[-3000:]
    assert "Traceback" not in served.log, served.log[-3000:]
    outcomes = check_outcomes(served.r, served.url, entries, served.fuzzed_message_ids)
    assert not outcomes.problems, outcomes.problems[:20]
    assert outcomes.num_results + outcomes.num_dead_lettered == len(entries)
    # The fuzz reached every exit: dead letters, validation failures, jobs run by the engine.
    assert outcomes.num_dead_lettered > 10 and outcomes.num_good_completed >= 24
    assert outcomes.num_completed - outcomes.num_good_completed > 20  # fuzzed jobs that ran
    assert outcomes.error_types["ValidationError"] > 10 and outcomes.error_types["InvalidJSON"] >= 3


@pytest.mark.timeout(180)
def test_the_entries_that_used_to_crash_workers(served):
    r, ids = served.r, served.crashers
    params = url_params(served.url)
    stream, group, prefix = params["stream"], params["group"], params["prefix"]
    assert served.returncode == 0, served.log[-3000:]
    assert "Traceback" not in served.log

    def result(job_id: str) -> JobResult:
        raw = r.get(constants.result_key(prefix, job_id))
        assert raw is not None, job_id
        return JobResult.model_validate_json(raw)

    dead = {
        fields[b"message_id"].decode(): fields[b"reason"].decode()
        for _, fields in r.xrange(constants.dead_letter_stream(stream))
        if fields[b"message_id"].decode() in ids.values()
    }
    assert dead.keys() == {ids["crashed"], ids["bad_id"], ids["bad_name"]}
    reason = "delivered 4 times; max_attempts is 3; last error: attempt 3 (worker w9) ended without a result"
    assert dead[ids["crashed"]] == reason
    assert (result("crashed").error.type, result("crashed").error.message) == ("DeadLettered", reason)
    assert dead[ids["bad_id"]] == "the entry's 'id' field is not UTF-8 text"
    assert "cannot read a job id" in dead[ids["bad_name"]]
    assert result("stop-ids").error.type == "InvalidParamsError"
    assert "stop_token_ids [999999] is outside the vocabulary [0, 49152)" in result("stop-ids").error.message
    assert result("top-k").status is JobStatus.COMPLETED and len(result("top-k").token_ids) == 4
    assert result("seed").error.type == "ValidationError" and "seed must be" in result("seed").error.message
    assert result("good").status is JobStatus.COMPLETED and len(result("good").token_ids) == 4
    assert r.xpending(stream, group)["pending"] == 0 and r.xlen(stream) == 0
