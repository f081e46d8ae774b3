"""An SQS and an S3 endpoint cut for longer than botocore's own retries, then back (issue 37).

One long-lived moto server keeps the queue and the bucket; a TCP proxy in front of it for each of
the two URLs (qworker/testing/tcp_proxy.py) is the endpoint that goes away: its listener closes
(new connections refused: EndpointConnectionError) and its live connections are cut (a call in
flight: ConnectionClosedError). The URLs set max_attempts=2, so a cut of two seconds outlasts
botocore's retries and the error reaches the worker, which must read it as an outage: log it,
back off, keep the jobs it holds (their results wait in the outbox, their leases stay theirs),
and, once the endpoint is back, finish every job exactly once.

Before the backends translated botocore's errors, the worker stopped on the first of them
(worker/retry.py read only redis and builtin errors as transient).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from qworker.backends.connections import open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.testing.tcp_proxy import CuttableProxy
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

NUM_JOBS_PER_PHASE = 6
CUT_S = 2.0  # botocore gives up after max_attempts=2 within about a second


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


@pytest.mark.timeout(120)
def test_sqs_and_s3_cut_past_botocore_retries_lose_and_repeat_no_job(sqs_s3, tiny_model_dir, caplog):
    env = sqs_s3(VisibilityTimeout="30")
    moto_port = urlsplit(env.moto.endpoint_url).port
    assert moto_port is not None
    with CuttableProxy(moto_port) as sqs_proxy, CuttableProxy(moto_port) as s3_proxy:
        query = f"region={env.moto.region}&max_attempts=2"
        queue_url = f"sqs://{env.queue}?{query}&endpoint_url=http://127.0.0.1:{sqs_proxy.port}"
        results_url = f"s3://{env.bucket}/results?{query}&endpoint_url=http://127.0.0.1:{s3_proxy.port}"
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=16
            )
        )
        settings = WorkerSettings(
            name="w", max_attempts=3, broker_outage_s=60, poll_interval_s=0.2, cancel_check_interval_s=0.2
        )
        worker = Worker(engine, open_source(queue_url, consumer="w"), open_sink(results_url), settings)
        # The producer and the reader talk to moto directly: only the worker's endpoints go away.
        client = Client(queue=env.queue_url, results=env.results_url)
        ids: list[str] = []
        cuts: list[str] = []
        failure: list[BaseException] = []

        def submit(phase: str) -> list[str]:
            job = {"params": {"max_tokens": 16, "ignore_eos": True}}
            return [
                client.submit({**job, "id": f"{phase}{i}", "prompt_token_ids": [5 + i, 6, 7]})
                for i in range(NUM_JOBS_PER_PHASE)
            ]

        def visible_messages() -> int:
            attrs = client.producer.sqs.get_queue_attributes(
                QueueUrl=client.producer.queue_url, AttributeNames=["ApproximateNumberOfMessages"]
            )["Attributes"]
            return int(attrs["ApproximateNumberOfMessages"])

        # Polled every 0.25 s: moto serves from this process, and a LIST at 100 Hz would take the
        # GIL from the worker. One client for all the polls: making one (env.result_keys() does,
        # each call) loads botocore's service model, tenths of a second of the GIL each time.
        s3 = env.s3()

        def all_done(job_ids: list[str]) -> bool:
            listed = s3.list_objects_v2(Bucket=env.bucket, Prefix="results/").get("Contents") or []
            return {f"results/{j}.json" for j in job_ids} <= {obj["Key"] for obj in listed}

        def outages() -> None:
            try:
                # S3 away while the worker holds jobs: results, cancel-flag polls fail (the
                # defect's call: list_objects_v2 on results/_cancel/).
                ids.extend(submit("s3-"))
                wait_until(lambda: worker.num_jobs_held > 0, 30, "jobs held before the S3 cut")
                s3_proxy.cut()
                cuts.append(f"s3 cut holding {worker.num_jobs_held}")
                time.sleep(CUT_S)
                s3_proxy.resume()
                wait_until(lambda: all_done(ids), 30, "the first phase's results", every_s=0.25)
                # SQS away while the worker holds jobs: receives, visibility extensions, acks fail.
                ids.extend(submit("sqs-"))
                # Every job received before the cut: a receive in flight at the cut would be
                # counted by SQS but lost on the way (its message then comes back after the
                # visibility timeout as a second delivery: at-least-once's due, not a defect).
                wait_until(
                    lambda: worker.num_jobs_held > 0 and visible_messages() == 0,
                    30,
                    "every job received before the SQS cut",
                    every_s=0.1,
                )
                sqs_proxy.cut()
                cuts.append(f"sqs cut holding {worker.num_jobs_held}")
                time.sleep(CUT_S)
                sqs_proxy.resume()
                wait_until(lambda: all_done(ids), 30, "the second phase's results", every_s=0.25)
            except BaseException as exc:
                failure.append(exc)
            finally:
                worker.stop()

        caplog.set_level(logging.WARNING, logger="qworker.worker.retry")
        driver = threading.Thread(target=outages, name="outages", daemon=True)
        driver.start()
        try:
            # The worker on the main thread (torch's CPU pool is slower off it), as in production.
            stats = worker.run()
        finally:
            worker.stop()
            driver.join(timeout=60)
        assert not failure, failure
        results = [client.result(job_id, timeout=10) for job_id in ids]
        client.close()

    assert [c.split(" holding")[0] for c in cuts] == ["s3 cut", "sqs cut"], cuts
    # The worker saw both outages as outages, logged them, and rode them out.
    messages = [r.getMessage() for r in caplog.records]
    unreachable = [m for m in messages if m.startswith("broker unreachable")]
    assert any(
        "Error" in m and ("ConnectionClosed" in m or "EndpointConnection" in m) for m in unreachable
    ), messages
    assert sum(m.startswith("broker reachable again") for m in messages) >= 2, messages
    assert worker.outage.num_outages >= 2
    # Every job finished exactly once: one completed result each, from its first delivery.
    assert stats.num_completed == len(ids) == 2 * NUM_JOBS_PER_PHASE
    assert stats.num_failed == 0 and stats.num_dead_lettered == 0 and stats.num_skipped_done == 0
    assert [r.status for r in results] == [JobStatus.COMPLETED] * len(ids)
    assert [r.attempts for r in results] == [1] * len(ids)
    assert sorted(env.result_keys()) == sorted(f"results/{job_id}.json" for job_id in ids)
    attrs = env.sqs().get_queue_attributes(QueueUrl=env.sqs_queue_url, AttributeNames=["All"])["Attributes"]
    assert attrs["ApproximateNumberOfMessages"] == "0"
    assert attrs["ApproximateNumberOfMessagesNotVisible"] == "0"
