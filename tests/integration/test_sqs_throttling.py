"""SQS and S3 calls ride out throttling and 5xx answers: a loopback HTTP proxy in front of moto's
server answers a fraction of requests itself (400 ThrottlingException or 500 for SQS, 503 SlowDown
or 500 for S3) without forwarding them, and botocore's retry mode, configured from the URL,
retries them. A worker on the tiny model serves 30 jobs through it; every job has one result,
ran once, and nothing is left on the queue or its dead-letter queue."""

from __future__ import annotations

import http.client
import json
import random
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from qworker.backends.connections import InvalidURLError, aws_retries, open_sink, open_source
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.jobs.client import Client
from qworker.jobs.job import JobStatus
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

NUM_JOBS = 30
FAULT_FRACTION = 0.15
SEED = 1234


class FaultProxy:
    """Forwards HTTP requests to `upstream`, except that a seeded fraction is answered with an
    error before it reaches the upstream (so that the service never saw it, as with a throttle)."""

    def __init__(self, upstream: str, fraction: float, seed: int) -> None:
        self.upstream = urlsplit(upstream)
        self.fraction = fraction
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy.pick_fault(self.headers)
                if fault is not None:
                    status, payload, headers = fault
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                conn.close()
                with proxy.lock:
                    proxy.forwarded += 1
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "server",
                        "date",
                    ):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def pick_fault(self, headers) -> tuple[int, bytes, dict[str, str]] | None:
        with self.lock:
            if self.fraction <= 0 or self.random.random() >= self.fraction:
                return None
            is_sqs = (headers.get("X-Amz-Target") or "").startswith("AmazonSQS")
            kind = self.random.choice(("throttle", "5xx"))
            self.injected[f"{'sqs' if is_sqs else 's3'}-{kind}"] += 1
        if is_sqs and kind == "throttle":
            payload = json.dumps(
                {"__type": "com.amazonaws.sqs#ThrottlingException", "message": "Rate exceeded"}
            )
            return (
                400,
                payload.encode(),
                {
                    "Content-Type": "application/x-amz-json-1.0",
                    "x-amzn-query-error": "ThrottlingException;Sender",
                },
            )
        if is_sqs:
            payload = json.dumps({"__type": "com.amazonaws.sqs#InternalError", "message": "injected"})
            return 500, payload.encode(), {"Content-Type": "application/x-amz-json-1.0"}
        code, status = ("SlowDown", 503) if kind == "throttle" else ("InternalError", 500)
        xml = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>"
        return status, xml.encode(), {"Content-Type": "application/xml"}

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_retry_options_come_from_the_url():
    assert aws_retries({}) == {"mode": "standard", "total_max_attempts": 8}
    assert aws_retries({"retry_mode": "adaptive", "max_attempts": "3"}) == {
        "mode": "adaptive",
        "total_max_attempts": 3,
    }
    for bad in (
        {"retry_mode": "legacy"},
        {"max_attempts": "0"},
        {"max_attempts": "2.5"},
        {"max_attempts": "99"},
    ):
        with pytest.raises(InvalidURLError):
            aws_retries(bad)


@pytest.mark.timeout(240)
def test_throttling_and_5xx_are_retried_and_no_job_is_lost_or_duplicated(sqs_s3, tiny_model_dir):
    env = sqs_s3(VisibilityTimeout="30")
    with FaultProxy(env.moto.endpoint_url, FAULT_FRACTION, SEED) as proxy:
        query = f"region={env.moto.region}&endpoint_url={proxy.endpoint_url}&max_attempts=10"
        # One run covers both retry modes, each under throttling and 5xx answers: the queue's
        # clients retry in standard mode, the results store's in adaptive mode (its rate limiter
        # on top of the same retries). The URLs are separate, so each client takes its own.
        queue_url = f"sqs://{env.queue}?{query}&retry_mode=standard"
        results_url = f"s3://{env.bucket}/results?{query}&retry_mode=adaptive"
        with Client(queue=queue_url, results=results_url) as client:
            ids = [
                client.submit(
                    {
                        "id": f"j{i}",
                        "prompt_token_ids": [5 + i, 6, 7],
                        "params": {"max_tokens": 3, "ignore_eos": True},
                    }
                )
                for i in range(NUM_JOBS)
            ]
            engine = LLMEngine(
                EngineConfig(
                    model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=16
                )
            )
            source, sink = open_source(queue_url, consumer="w"), open_sink(results_url)
            # Each URL's retry mode reached its own botocore client.
            assert source.sqs.meta.config.retries["mode"] == "standard"
            assert sink.s3.meta.config.retries["mode"] == "adaptive"
            worker = Worker(engine, source, sink, WorkerSettings(name="w", max_attempts=3))
            stats = worker.run(burst=True)
            results = [client.result(job_id, timeout=30) for job_id in ids]
    # Faults of every kind reached the clients and none surfaced.
    assert set(proxy.injected) == {"sqs-throttle", "sqs-5xx", "s3-throttle", "s3-5xx"}, proxy.injected
    assert stats.num_completed == NUM_JOBS and stats.num_failed == 0 and stats.num_dead_lettered == 0
    assert stats.num_skipped_done == 0 and stats.num_released == 0
    assert [r.status for r in results] == [JobStatus.COMPLETED] * NUM_JOBS
    # Each job was delivered once: a retried call never lost a receipt or a visibility change.
    assert [r.attempts for r in results] == [1] * NUM_JOBS
    assert sorted(env.result_keys()) == sorted(f"results/{job_id}.json" for job_id in ids)
    attrs = env.sqs().get_queue_attributes(QueueUrl=env.sqs_queue_url, AttributeNames=["All"])["Attributes"]
    assert (
        attrs["ApproximateNumberOfMessages"] == "0" and attrs["ApproximateNumberOfMessagesNotVisible"] == "0"
    )
