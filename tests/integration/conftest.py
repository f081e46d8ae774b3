"""Shared fixtures for integration tests: moto's server mode on loopback (SQS and S3 over HTTP),
a tiny random Llama directory with the SmolLM2 tokenizer, and a queue URL of the test's own on
the tests' Redis (`url`, its keys deleted after the test)."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import redis as redis_lib

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url, write_tiny_model_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_redis(url: str) -> redis_lib.Redis:
    """A client of the Redis that a unique_url's queue lives on."""
    return redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url)


def url_params(url: str) -> dict[str, str]:
    return parse_url(url, SOURCE_PARAMS | SINK_PARAMS).params


@pytest.fixture
def url(request: pytest.FixtureRequest):
    """A queue-and-results URL of this test's own (stream, group and key prefix, tagged with the
    module's name) on the tests' Redis; its keys are deleted after the test."""
    tag = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    url = unique_url(redis_base_url(), tag=tag)
    yield url
    cleanup(raw_redis(url), url)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-shared"))


@dataclass
class MotoServer:
    endpoint_url: str
    region: str

    def client(self, service: str):
        import boto3

        session = boto3.session.Session()
        return session.client(service, region_name=self.region, endpoint_url=self.endpoint_url)

    @property
    def query(self) -> str:
        return f"region={self.region}&endpoint_url={self.endpoint_url}"


@pytest.fixture(scope="session")
def moto_server():
    """moto in server mode on 127.0.0.1 (boto3 talks HTTP to it, as to AWS). Credentials are fake
    and set in the environment, so that worker subprocesses find them through boto3's chain."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.delenv("AWS_PROFILE", raising=False)
        yield MotoServer(f"http://127.0.0.1:{port}", "us-east-1")
    server.stop()


@dataclass
class SqsS3:
    """One test's queue and bucket on the moto server, with their qworker URLs."""

    moto: MotoServer
    queue: str
    bucket: str
    queue_url: str  # qworker's sqs:// URL
    results_url: str  # qworker's s3:// URL
    sqs_queue_url: str  # the queue's https URL, for boto3

    def sqs(self):
        return self.moto.client("sqs")

    def s3(self):
        return self.moto.client("s3")

    def result_keys(self) -> list[str]:
        keys = []
        pages = self.s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix="results/")
        for page in pages:
            keys += [obj["Key"] for obj in page.get("Contents") or []]
        return keys


@pytest.fixture
def sqs_s3(moto_server) -> Callable[..., SqsS3]:
    """Make a fresh queue (attributes as given) and bucket: sqs_s3(VisibilityTimeout="2")."""

    def make(fifo: bool = False, **attributes: str) -> SqsS3:
        tag = uuid.uuid4().hex[:10]
        name = f"qw-{tag}" + (".fifo" if fifo else "")
        if fifo:
            attributes = {"FifoQueue": "true", **attributes}
        sqs = moto_server.client("sqs")
        queue_url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        bucket = f"qw-{tag}"
        moto_server.client("s3").create_bucket(Bucket=bucket)
        return SqsS3(
            moto_server,
            name,
            bucket,
            f"sqs://{name}?{moto_server.query}",
            f"s3://{bucket}/results?{moto_server.query}",
            queue_url,
        )

    return make


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
