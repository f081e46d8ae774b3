"""A `qworker worker --metrics-port` process, started the documented way (the queue URL in
QWORKER_QUEUE_URL, not on the command line), on the real Redis and a tiny random model:

- /metrics after 30 jobs (completed, failed, cancelled while queued and while running): the job
  counters equal the stored results by status, the token counters their usage sums;
- /readyz: 503 before the model is loaded, 200 once serving, 503 during the SIGTERM drain;
- the process's command line shows no queue URL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import redis as redis_lib
from prometheus_client.parser import text_string_to_metric_families

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.backends.redis import keys as constants
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(port: int, path: str) -> int | None:
    """The status of GET path, or None while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def long_job(max_tokens: int) -> dict:
    return {"prompt_token_ids": [5, 6, 7, 8], "params": {"max_tokens": max_tokens, "ignore_eos": True}}


def test_metrics_and_readiness_of_a_worker_process(url, tiny_model_dir, tmp_path: Path):
    params = parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params
    client = Client(queue=url)
    r = redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url)

    # Queued before the worker starts: 20 that complete, 5 that fail, 3 cancelled while queued,
    # and one message without any id (dead-lettered: no result to store).
    job_ids = [
        client.submit({"prompt": f"count to {i}", "params": {"max_tokens": 4 + i % 5}}) for i in range(20)
    ]
    bad_bodies = {
        "bad-json": b"\xff{not json",
        "bad-field": b'{"prompt": "hi", "params": {"max_tokens": 4, "temprature": 1}}',
        "bad-token": b'{"prompt_token_ids": [1, 99999999]}',
        "too-long": ('{"prompt_token_ids": [' + ",".join(["7"] * 2000) + "]}").encode(),
        "no-prompt": b'{"params": {"max_tokens": 4}}',
    }
    for job_id, body in bad_bodies.items():
        r.xadd(params["stream"], {constants.FIELD_JOB_ID: job_id, constants.FIELD_BODY: body})
    job_ids += list(bad_bodies)
    for _ in range(3):
        job_id = client.submit(long_job(8))
        client.cancel(job_id)
        job_ids.append(job_id)
    r.xadd(params["stream"], {constants.FIELD_BODY: b"\x00 no id"})

    port = free_port()
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qworker",
                "worker",
                "--model",
                str(tiny_model_dir),
                "--name",
                "metrics-w",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--num-kv-blocks",
                "256",
                "--metrics-port",
                str(port),
                # Long enough that the job running at SIGTERM finishes instead of being released.
                "--drain-grace-s",
                "120",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "QWORKER_QUEUE_URL": url, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        )
    try:
        # The endpoints come up before torch is imported and the model loaded: not ready yet.
        first = wait_until(lambda: http_status(port, "/readyz"), 60, "the metrics port")
        is_ready_line = "worker metrics-w ready" in log_path.read_text()
        assert first == 503 and not is_ready_line, log_path.read_text()[-2000:]
        # While torch is imported the one-thread server may answer slowly: a miss is retried.
        assert wait_until(lambda: http_status(port, "/healthz"), 30, "/healthz") == 200

        # No URL on the command line: `ps` shows no password.
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
        assert "redis://" not in cmdline and params["stream"] not in cmdline

        wait_until(lambda: http_status(port, "/readyz") == 200, 120, "readiness")
        # Two more cancelled, each while running.
        for _ in range(2):
            job_id = client.submit(long_job(1000))
            for _ in client.stream(job_id, timeout=60):
                client.cancel(job_id)
                break
            job_ids.append(job_id)
        assert len(job_ids) == 30

        results = [client.result(job_id, timeout=120) for job_id in job_ids]
        by_status = Counter(result.status.value for result in results)
        assert by_status == {"completed": 20, "failed": 5, "cancelled": 5}, by_status
        wait_until(
            lambda: sum(v for (n, _), v in scrape(port).items() if n == "qworker_jobs_total") == 30,
            10,
            "the job counters",
        )
        samples = scrape(port)
        for status in JobStatus:
            assert samples[("qworker_jobs_total", (("status", status.value),))] == by_status[status.value]
        assert samples[("qworker_prompt_tokens_total", ())] == sum(x.usage.prompt_tokens for x in results)
        assert samples[("qworker_generation_tokens_total", ())] == sum(
            x.usage.completion_tokens for x in results
        )
        assert samples[("qworker_dead_lettered_jobs_total", (("reason", "Unreadable"),))] == 1
        assert samples[("qworker_e2e_latency_seconds_count", ())] == 30
        assert samples[("qworker_time_to_first_token_seconds_count", ())] == sum(
            1 for x in results if x.timings.first_token_at is not None
        )
        assert samples[("qworker_inter_token_latency_seconds_count", ())] > 0
        wait_until(
            lambda: scrape(port)[("qworker_kv_cache_total_blocks", ())] == 256, 10, "the engine gauges"
        )
        info = [dict(labels) for (name, labels), _ in samples.items() if name == "qworker_worker_info"]
        assert info and info[0]["model"] == str(tiny_model_dir) and info[0]["dtype"] == "float32"

        # A drain: not ready from the signal on, alive, and the running job still finishes.
        draining_id = client.submit(long_job(300))
        for _ in client.stream(draining_id, timeout=60):
            break
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: http_status(port, "/readyz") == 503, 10, "not ready while draining")
        assert process.poll() is None, "the drain should still be running"
        assert http_status(port, "/healthz") == 200
        assert process.wait(timeout=150) == 0
        assert client.result(draining_id, timeout=10).status is JobStatus.COMPLETED
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        client.close()
