"""Stream readers see attempts: when a job's worker is killed (SIGKILL) or releases it (SIGTERM)
mid-generation, a peer resumes it from the tokens its delta stream holds (docs/queues.md "Resume
from tokens"), and the text a `Client.stream` reader assembles, live across the resume, equals the
stored result's text. Real worker processes on a tiny random Llama with the SmolLM2 tokenizer, on
the real Redis.

One pool for the module: each test stops the live worker and starts its successor, which takes
the job (three worker starts for the two stops, not four; the SIGKILL test's peer is the SIGTERM
test's victim).
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.backends.redis import keys as constants
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.worker_kit import cleanup, kill_group, redis_base_url, spawn_worker, unique_url
from tests.integration.conftest import wait_for
from tests.integration.streaming import StreamReader, raw_redis

# 256 KV blocks hold a 200-token job 19 times over, and build in 0.4 s where the 16384 sized from
# memory take 1.5 s (engine construction of the tiny model, 2-core EPYC).
WORKER_ARGS = ("--lease-timeout-s", "2", "--drain-grace-s", "0", "--num-kv-blocks", "256")
# Stopped once 30 deltas are streamed, the peer generates the other 170: margin enough for the stop
# to land mid-generation (each test checks that no result is stored before the peer starts).
MAX_TOKENS = 200
NUM_TOKENS_BEFORE_STOP = 30


@dataclass
class Pool:
    url: str
    folder: Path
    model_dir: Path
    live: subprocess.Popen | None = None
    live_name: str = ""
    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> str:
        name = f"w{len(self.processes) + 1}"
        self.live = spawn_worker(self.url, self.model_dir, name, *WORKER_ARGS, log_path=self.log_path(name))
        self.live_name = name
        self.processes.append(self.live)
        return name

    def log_path(self, name: str) -> Path:
        return self.folder / f"{name}.log"


@pytest.fixture(scope="module")
def pool(tiny_model_dir, tmp_path_factory):
    url = unique_url(redis_base_url(), tag="redelivery_stream")
    pool = Pool(url, tmp_path_factory.mktemp("redelivery-stream"), tiny_model_dir)
    returncode = None
    try:
        pool.start()
        yield pool
        if pool.live is not None and pool.live.poll() is None:
            pool.live.send_signal(signal.SIGTERM)
            returncode = pool.live.wait(timeout=60)
    finally:
        for process in pool.processes:
            kill_group(process)
        cleanup(raw_redis(url), url)
    # The last peer, idle, exits cleanly on SIGTERM (a test stopped each earlier worker).
    assert returncode in (None, 0), returncode


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop_signal", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_text_streamed_across_a_rerun_equals_the_result(pool, stop_signal):
    url = pool.url
    params = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params
    r = raw_redis(url)
    client = Client(queue=url)
    victim, victim_name = pool.live, pool.live_name
    assert victim is not None and victim.poll() is None
    # The victim samples for another job first: its random state then differs from the fresh
    # peer's, as between any two workers, and only the job's own seed makes the rerun agree.
    other = client.submit({"prompt_token_ids": [5, 6], "params": {"max_tokens": 5, "ignore_eos": True}})
    assert client.result(other, timeout=60).status is JobStatus.COMPLETED
    # Sampled (temperature 1) without a seed, and long enough to be stopped mid-generation.
    job_id = client.submit(
        {"prompt_token_ids": [1, 520, 3000, 17], "params": {"max_tokens": MAX_TOKENS, "ignore_eos": True}}
    )
    deltas_key = constants.delta_stream_key(params["prefix"], job_id)
    reader = StreamReader(url, job_id, timeout_s=120)
    reader.start()
    wait_for(lambda: r.xlen(deltas_key) >= NUM_TOKENS_BEFORE_STOP, 60, "the victim to stream some tokens")
    victim.send_signal(stop_signal)
    returncode = victim.wait(timeout=30)
    assert returncode == (0 if stop_signal == signal.SIGTERM else -signal.SIGKILL)
    if stop_signal == signal.SIGTERM:
        assert "released 1 jobs" in pool.log_path(victim_name).read_text()
    assert not client.sink.has_result(job_id), "the job must be stopped mid-generation"
    wait_for(lambda: reader.text, 10, "the reader to see the first attempt's text")
    seen_before_rerun = reader.text
    peer_name = pool.start()
    result = client.result(job_id, timeout=180)
    reader.join(timeout=60)
    assert (result.status, result.attempts, result.worker) == (JobStatus.COMPLETED, 2, peer_name)
    assert len(result.token_ids) == MAX_TOKENS
    # The startup line names the results store (the queue's server) without the queue's ?stream=.
    startup = next(line for line in pool.log_path(peer_name).read_text().splitlines() if ": queue " in line)
    assert "results on the queue's server redis://" in startup and "?" not in startup.split("results")[1]
    assert reader.error is None, repr(reader.error)
    assert reader.text == result.text
    assert reader.text.startswith(seen_before_rerun) and len(seen_before_rerun) < len(result.text)
    # On the wire: the first attempt's deltas, the peer's resume marker (the tokens and text it
    # keeps of them), the rest of the text, done.
    entries = [fields for _, fields in r.xrange(deltas_key)]
    markers = [i for i, fields in enumerate(entries) if b"attempt" in fields]
    assert [entries[i][b"attempt"] for i in markers] == [b"2"]
    num_tokens, num_chars = (int(entries[markers[0]][k]) for k in (b"resume_tokens", b"resume_chars"))
    first = b"".join(fields.get(b"text", b"") for fields in entries[: markers[0]]).decode()
    assert num_tokens >= NUM_TOKENS_BEFORE_STOP - 1 and first[:num_chars] == result.text[:num_chars]
    rerun = entries[markers[0] + 1 :]
    assert b"".join(fields.get(b"text", b"") for fields in rerun).decode() == result.text[num_chars:]
    assert [int(fields[b"pos"]) for fields in rerun[:3]] == [num_tokens, num_tokens + 1, num_tokens + 2]
    assert b"done" in rerun[-1]
    # A reader that starts now reads the kept text and the rest.
    assert "".join(client.stream(job_id, timeout=10)) == result.text
