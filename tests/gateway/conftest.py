"""Fixtures for gateway tests: a gateway served by uvicorn in a thread on a loopback port, and
worker subprocesses (one thread each) on the real Redis."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import redis
import uvicorn

from qworker.gateway.app import create_app
from qworker.gateway.http_protocol import server_options
from qworker.gateway.settings import GatewaySettings
from qworker.jobs.client import Client
from qworker.testing.worker_kit import cleanup, redis_base_url, spawn_worker, unique_url

API_KEY = "sk-test-" + uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServedGateway:
    url: str  # http://127.0.0.1:PORT
    app: Any

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


@contextmanager
def serve_app(app: Any, **config: Any) -> Iterator[ServedGateway]:
    """Serve `app` with uvicorn on a free loopback port until the block ends."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield ServedGateway(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def metric_value(text: str, name: str) -> float | None:
    """A sample's value in Prometheus text (the first line that starts with `name`)."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


# -- one pool for the whole gateway suite: a SmolLM2 worker (fp32, one thread) and a gateway --


@pytest.fixture(scope="session")
def pool_url():
    url = unique_url(redis_base_url(), "gateway")
    yield url
    cleanup(redis.Redis.from_url(redis_base_url()), url)


@pytest.fixture(scope="session")
def worker(pool_url, tmp_path_factory):
    metrics_port = free_port()
    log = tmp_path_factory.mktemp("gateway-worker") / "worker.log"
    process = spawn_worker(
        pool_url,
        "smollm2",
        "gw-w1",
        "--metrics-port",
        str(metrics_port),
        # The KV gauges are refreshed with the stats: often, so that the disconnect test sees blocks
        # freed within its 1 s and not a reading up to a second old.
        "--stats-interval-s",
        "0.05",
        log_path=log,
    )
    yield f"http://127.0.0.1:{metrics_port}/metrics"
    process.terminate()
    process.wait(timeout=60)


@pytest.fixture(scope="session")
def gateway(pool_url):
    # Started before any worker (scale from zero). The tokenizer is loaded on first use: the
    # SmolLM2 directory a worker converts once.
    settings = GatewaySettings(request_timeout_s=120)
    app = create_app(settings, queue=pool_url, api_keys=frozenset({API_KEY}))
    # The server options `qworker gateway` runs with: its protocol class sets the disconnect
    # event that the routes wait on.
    with serve_app(app, **server_options(settings)) as served:
        yield served


@pytest.fixture(scope="session")
def sdk(gateway):
    return openai.OpenAI(base_url=gateway.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def store(pool_url):
    with Client(queue=pool_url) as client:
        yield client
