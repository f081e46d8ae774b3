"""Through the worker, with `--batch-invariant`: 5 greedy chat jobs and one seeded sampled job on
the real SmolLM2 in fp32, the worker SIGKILLed mid-run, a peer finishing them in another batch
composition. Every rerun's text starts with (and so repeats) what its first attempt had streamed,
`Client.stream` raises nothing, and the stored text is what the reader assembled. Real worker
processes on the real Redis.

fp32: the claim is about redelivery, and `--batch-invariant` holds in fp32 too; on a CPU without
bf16 hardware bf16 matmuls are emulated and several times slower. test_batch_invariance_batch.py
checks bf16 batch invariance through workers.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis as redis_lib

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.backends.redis import keys as constants
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url
from tests.integration.conftest import wait_for
from tests.integration.streaming import StreamReader, raw_redis

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
    "Write one sentence about cats.",
    "How many legs does a spider have?",
]
MAX_TOKENS = 24


@pytest.fixture
def url():
    url = unique_url(redis_base_url(), tag="invariant")
    yield url
    cleanup(raw_redis(url), url)


def first_attempt_text(r: redis_lib.Redis, deltas_key: str) -> str:
    """The text a job's first attempt streamed: its deltas before the first attempt marker."""
    text = []
    for _, fields in r.xrange(deltas_key):
        if b"attempt" in fields:
            break
        text.append(fields.get(b"text", b"").decode())
    return "".join(text)


def test_redelivered_jobs_repeat_their_text(url: str, tmp_path: Path) -> None:
    prefix = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params["prefix"]
    r = raw_redis(url)
    client = Client(queue=url)
    common = ("--dtype", "float32", "--batch-invariant", "--lease-timeout-s", "2", "--drain-grace-s", "0")
    victim = spawn_worker(url, Path("smollm2"), "victim", *common, log_path=tmp_path / "victim.log")
    peer = None
    try:
        jobs = [
            {
                "messages": [{"role": "user", "content": q}],
                "params": {"max_tokens": MAX_TOKENS, "temperature": 0},
            }
            for q in QUESTIONS
        ]
        jobs.append(
            {
                "messages": [{"role": "user", "content": "Tell me a story about a dragon."}],
                "params": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1234, "ignore_eos": True},
            }
        )
        job_ids = client.submit_many(jobs)
        readers = [StreamReader(url, job_id, timeout_s=300) for job_id in job_ids]
        for reader in readers:
            reader.start()
        keys = [constants.delta_stream_key(prefix, job_id) for job_id in job_ids]
        # Mid-run: every job has streamed something, none is done.
        wait_for(lambda: all(r.xlen(k) >= 3 for k in keys), 240, "every job to stream some tokens")
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        first = {job_id: first_attempt_text(r, k) for job_id, k in zip(job_ids, keys, strict=True)}
        peer = spawn_worker(url, Path("smollm2"), "peer", *common, log_path=tmp_path / "peer.log")
        results = client.results(job_ids, timeout=300)
        for reader in readers:
            reader.join(timeout=60)
    finally:
        for process in (victim, peer):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        if peer is not None:
            assert peer.wait(timeout=60) == 0
    rerun = [res for res in results if res.attempts == 2]
    assert len(rerun) >= 1, "no job was redelivered"
    for job_id, result, reader in zip(job_ids, results, readers, strict=True):
        assert result.status is JobStatus.COMPLETED, result
        if result.attempts == 2:
            assert result.text.startswith(first[job_id]), (job_id, first[job_id], result.text)
        assert reader.error is None, repr(reader.error)
        assert reader.text == result.text
