"""Resume from tokens on the real SmolLM2 (fp32, `--batch-invariant`), through worker processes on
the real Redis: a worker SIGKILLed, then one SIGTERMed past its drain grace, mid-generation; the
peer that takes their jobs resumes them from the tokens their delta streams hold. A greedy and a
seeded sampled job each end with exactly the token ids of an uninterrupted run, the text a
`Client.stream` reader assembled live has no repeat and no gap, and usage counts every token
once. Stored tokens that are corrupt or longer than max_tokens restart the job from zero, logged.

fp32: the claim is about resuming, and `--batch-invariant` makes fp32 runs exact too; on a CPU
without bf16 hardware bf16 matmuls are emulated and several times slower.
test_batch_invariance_batch.py checks bf16 batch invariance through workers.

One pool for the module: the first worker runs the uninterrupted references; each test stops the
live worker and starts its successor (three SmolLM2 workers in all).
"""

from __future__ import annotations

import json
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.backends.redis import keys
from qworker.jobs.client import Client
from qworker.jobs.job import Job, JobResult, JobStatus, encode_job
from qworker.testing.worker_kit import cleanup, kill_group, redis_base_url, spawn_worker, unique_url
from tests.integration.conftest import wait_for
from tests.integration.streaming import StreamReader, raw_redis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# 24 tokens: the stop at 8 leaves 16 steps to land in (stop_mid_run checks that no result is stored).
MAX_TOKENS = 24
# Stopped once this many deltas are stored: mid-generation, the resume keeps at least these.
NUM_TOKENS_BEFORE_STOP = 8
JOBS = {
    "greedy": {
        "messages": [{"role": "user", "content": "Describe the sea in three sentences."}],
        "params": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
    },
    "seeded": {
        "messages": [{"role": "user", "content": "Tell me a story about a dragon."}],
        "params": {
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "top_p": 0.95,
            "seed": 1234,
            "ignore_eos": True,
        },
    },
}
WORKER_ARGS = ("--dtype", "float32", "--batch-invariant", "--lease-timeout-s", "2", "--drain-grace-s", "0")


@dataclass
class Pool:
    url: str
    tmp: Path
    client: Client
    prefix: str
    stream: str
    live: subprocess.Popen | None = None
    num_started: int = 0
    references: dict[str, JobResult] = field(default_factory=dict)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> subprocess.Popen:
        self.num_started += 1
        name = f"w{self.num_started}"
        self.live = spawn_worker(
            self.url, Path("smollm2"), name, *WORKER_ARGS, log_path=self.tmp / f"{name}.log"
        )
        self.processes.append(self.live)
        return self.live

    def log(self, process: subprocess.Popen) -> str:
        index = self.processes.index(process) + 1
        return (self.tmp / f"w{index}.log").read_text()

    def deltas_key(self, job_id: str) -> str:
        return keys.delta_stream_key(self.prefix, job_id)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    url = unique_url(redis_base_url(), tag="resume")
    params = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params
    pool = Pool(url, tmp_path_factory.mktemp("resume"), Client(queue=url), params["prefix"], params["stream"])
    try:
        pool.start()
        ids = pool.client.submit_many(list(JOBS.values()))
        results = pool.client.results(ids, timeout=240)
        pool.references = dict(zip(JOBS, results, strict=True))
        for result in results:
            assert result.status is JobStatus.COMPLETED and len(result.token_ids) == MAX_TOKENS, result
        yield pool
    finally:
        for process in pool.processes:
            kill_group(process)
        cleanup(raw_redis(url), url)


def stop_mid_run(pool: Pool, stop_signal: signal.Signals) -> tuple[dict[str, str], dict[str, StreamReader]]:
    """Submit the jobs again to the live worker, start a live reader on each, and stop the worker
    with `stop_signal` once each has stored some tokens; then start its successor."""
    r = raw_redis(pool.url)
    victim = pool.live
    assert victim is not None
    job_ids = dict(zip(JOBS, pool.client.submit_many(list(JOBS.values())), strict=True))
    readers = {kind: StreamReader(pool.url, job_id, timeout_s=120) for kind, job_id in job_ids.items()}
    for reader in readers.values():
        reader.start()
    wait_for(
        lambda: all(r.xlen(pool.deltas_key(j)) >= NUM_TOKENS_BEFORE_STOP for j in job_ids.values()),
        120,
        "every job to store some tokens",
    )
    victim.send_signal(stop_signal)
    returncode = victim.wait(timeout=60)
    assert returncode == (0 if stop_signal == signal.SIGTERM else -signal.SIGKILL)
    for job_id in job_ids.values():
        assert not pool.client.sink.has_result(job_id), "the job must be stopped mid-generation"
    pool.start()
    return job_ids, readers


def check_resumed(pool: Pool, job_ids: dict[str, str], readers: dict[str, StreamReader]) -> None:
    r = raw_redis(pool.url)
    for kind, job_id in job_ids.items():
        result = pool.client.result(job_id, timeout=180)
        readers[kind].join(timeout=60)
        reference = pool.references[kind]
        assert result.status is JobStatus.COMPLETED and result.attempts == 2, (kind, result)
        # Exactly an uninterrupted run's tokens and text (--batch-invariant), counted once.
        assert result.token_ids == reference.token_ids, kind
        assert result.text == reference.text, kind
        assert result.usage.completion_tokens == MAX_TOKENS == len(result.token_ids)
        assert result.usage.prompt_tokens == reference.usage.prompt_tokens
        # The peer resumed: its marker keeps the first attempt's tokens, and it streamed the rest.
        entries = [fields for _, fields in r.xrange(pool.deltas_key(job_id))]
        [mark] = [i for i, fields in enumerate(entries) if b"attempt" in fields]
        num_tokens = int(entries[mark][b"resume_tokens"])
        num_chars = int(entries[mark][b"resume_chars"])
        assert NUM_TOKENS_BEFORE_STOP <= num_tokens < MAX_TOKENS, (kind, num_tokens)
        first = [json.loads(f[b"token_ids"]) for f in entries[:mark]]
        assert [t for ids in first for t in ids][:num_tokens] == reference.token_ids[:num_tokens]
        rest = entries[mark + 1 :]
        assert (
            sum(len(json.loads(f[b"token_ids"])) for f in rest if b"token_ids" in f)
            == MAX_TOKENS - num_tokens
        )
        first_text = b"".join(f[b"text"] for f in entries[:mark]).decode()
        rest_text = b"".join(f.get(b"text", b"") for f in rest).decode()
        assert first_text[:num_chars] + rest_text == reference.text
        # The live reader: the uninterrupted text, no repeat, no gap, no restart.
        assert readers[kind].error is None, repr(readers[kind].error)
        assert readers[kind].text == reference.text, kind
    for job_id in job_ids.values():
        assert f"job {job_id} resumes from " in pool.log(pool.live)


def test_resume_after_sigkill(pool) -> None:
    job_ids, readers = stop_mid_run(pool, signal.SIGKILL)
    check_resumed(pool, job_ids, readers)


def test_resume_after_sigterm_past_the_grace(pool) -> None:
    job_ids, readers = stop_mid_run(pool, signal.SIGTERM)
    victim_log = pool.log(pool.processes[-2])
    assert "released 2 jobs" in victim_log
    check_resumed(pool, job_ids, readers)


def test_stored_tokens_that_cannot_resume_restart_from_zero(pool) -> None:
    """Delta streams written as if an earlier attempt had died: corrupt entries, more tokens than
    max_tokens, tokens that do not decode to their text. The live worker reclaims each job (its
    first delivery taken by a consumer that never acks), logs that it restarts from zero, and
    ends with the uninterrupted run's tokens."""
    r = raw_redis(pool.url)
    body = JOBS["greedy"]
    reference = pool.references["greedy"]
    many = reference.token_ids * 2  # 48 tokens: past max_tokens
    stored = {
        "not-json": [{"text": "x", "token_ids": "[1, 2", "pos": 0}],
        "not-ids": [{"text": "x", "token_ids": json.dumps(["a", "b"]), "pos": 0}],
        "too-long": [{"text": reference.text * 2, "token_ids": json.dumps(many), "pos": 0}],
        "wrong-text": [{"text": "not this text", "token_ids": json.dumps(reference.token_ids[:5]), "pos": 0}],
    }
    job_ids = {name: f"hostile-{name}" for name in stored}
    for name, job_id in job_ids.items():
        for entry in stored[name]:
            r.xadd(pool.deltas_key(job_id), entry)
    # Each first delivery goes to a consumer that never acks, in the transaction that enqueues
    # the job (the live worker, blocked on the stream, is served after it and finds nothing):
    # the worker reclaims them past the lease timeout (2 s), as second deliveries.
    pipe = r.pipeline(transaction=True)
    for job_id in job_ids.values():
        pipe.xadd(
            pool.stream, {keys.FIELD_JOB_ID: job_id, keys.FIELD_BODY: encode_job(Job(id=job_id, **body))}
        )
    pipe.xreadgroup("g", "ghost", {pool.stream: ">"}, count=len(job_ids))
    taken = pipe.execute()[-1]
    assert sum(len(entries) for _, entries in taken) == len(job_ids)
    for name, job_id in job_ids.items():
        result = pool.client.result(job_id, timeout=120)
        assert result.status is JobStatus.COMPLETED and result.attempts == 2, (name, result)
        assert result.token_ids == reference.token_ids, name
        assert result.usage.completion_tokens == MAX_TOKENS
        log = pool.log(pool.live)
        assert f"job {job_id} restarts from zero: its stored tokens cannot be resumed" in log, name
