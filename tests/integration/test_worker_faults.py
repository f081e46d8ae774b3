"""Faults with real worker processes: SIGKILL loses nothing, SIGTERM drains and hands the rest to
a peer. Workers run `python -m qworker.cli worker` on a tiny random model with the SmolLM2
tokenizer."""

from __future__ import annotations

import signal
import time

import pytest

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.backends.redis import keys as constants
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import spawn_worker
from tests.integration.conftest import raw_redis, wait_for


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir


def pending_of(r, params, consumer: str) -> int:
    for entry in r.xpending(params["stream"], params["group"])["consumers"]:
        if entry["name"].decode() == consumer:
            return int(entry["pending"])
    return 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_loses_nothing(url, tiny_dir, tmp_path):
    params = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params
    r = raw_redis(url)
    client = Client(queue=url)
    num_jobs = 300
    job_ids = client.submit_many(
        [
            {
                "prompt_token_ids": [10 + i % 97, 11, 12],
                "params": {"max_tokens": 8 + i % 9, "ignore_eos": True},
            }
            for i in range(num_jobs)
        ]
    )
    common = ("--lease-timeout-s", "2", "--num-kv-blocks", "256", "--max-backlog", "8")
    victim = spawn_worker(url, tiny_dir, "victim", *common, log_path=tmp_path / "victim.log")
    peer = spawn_worker(url, tiny_dir, "peer", *common, log_path=tmp_path / "peer.log")
    try:
        # Kill the victim while it holds running jobs (some of its output already streamed).
        wait_for(lambda: pending_of(r, params, "victim") >= 4, 60, "the victim to hold jobs")
        wait_for(
            lambda: any(r.exists(constants.delta_stream_key(params["prefix"], j)) for j in job_ids[:40]),
            60,
            "streamed tokens",
        )
        held_when_killed = pending_of(r, params, "victim")
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        assert held_when_killed > 0
        results = client.results(job_ids, timeout=240)
    finally:
        for process in (victim, peer):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        assert peer.wait(timeout=60) == 0
    assert len({res.id for res in results}) == num_jobs, "a job is missing"
    assert all(res.status is JobStatus.COMPLETED for res in results)
    # Exactly one result per job: each result write also ends the job's delta stream with a done
    # marker, so a job whose result was written twice would show two.
    for job_id in job_ids:
        entries = r.xrange(constants.delta_stream_key(params["prefix"], job_id))
        assert sum(b"done" in fields for _, fields in entries) == 1, job_id
    reclaimed = [res for res in results if res.attempts > 1]
    assert reclaimed and all(res.worker == "peer" for res in reclaimed)
    info = r.xpending(params["stream"], params["group"])
    assert info["pending"] == 0, info
    assert r.xlen(params["stream"]) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_drains_releases_and_a_peer_finishes(url, tiny_dir, tmp_path):
    params = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params
    r = raw_redis(url)
    client = Client(queue=url)
    short_ids = client.submit_many(
        [
            {"prompt_token_ids": [20, 21, 22], "params": {"max_tokens": 4, "ignore_eos": True}}
            for _ in range(3)
        ]
    )
    # Long jobs that cannot finish within the grace period (600 steps in the 2.5 s it leaves
    # after its margin would take under 4.2 ms a step); more than the 4 it must hold.
    long_ids = client.submit_many(
        [
            {"prompt_token_ids": [30 + i, 31], "params": {"max_tokens": 600, "ignore_eos": True}}
            for i in range(6)
        ]
    )
    grace_s = 3.0
    worker = spawn_worker(
        url, tiny_dir, "draining", "--drain-grace-s", str(grace_s), "--lease-timeout-s", "30",
        "--max-backlog", "4", log_path=tmp_path / "draining.log",
    )  # fmt: skip
    wait_for(lambda: client.sink.has_result(short_ids[-1]), 60, "the short jobs")
    wait_for(lambda: pending_of(r, params, "draining") >= 4, 60, "the worker to hold long jobs")
    signalled = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=grace_s + 10) == 0
    assert time.monotonic() - signalled <= grace_s + 1.5, "exit within the grace period"
    log = (tmp_path / "draining.log").read_text()
    assert "released" in log
    # A peer with a 30 s lease takes the released jobs at once: they were marked long idle.
    peer = spawn_worker(
        url,
        tiny_dir,
        "peer",
        "--lease-timeout-s",
        "30",
        "--max-backlog",
        "16",
        log_path=tmp_path / "peer.log",
    )
    try:
        started = time.monotonic()
        results = client.results(long_ids, timeout=200)
        assert all(res.status is JobStatus.COMPLETED and res.worker == "peer" for res in results)
        assert time.monotonic() - started < 200
    finally:
        peer.send_signal(signal.SIGTERM)
        assert peer.wait(timeout=60) == 0
    assert all(client.result(j, timeout=1).worker == "draining" for j in short_ids)
    info = r.xpending(params["stream"], params["group"])
    assert info["pending"] == 0, info
