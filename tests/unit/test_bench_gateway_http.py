"""The bench's http mode (qworker/bench/gateway_http.py) through a real gateway app in front of the
in-memory queue and a FakeEngine worker (no model, no Redis): each request is one streaming
/v1/completions, its record has client-side TTFT, chunk times and the usage's token count, a
request the gateway refuses is a counted failure, and `--mode queue,http` puts the http system in
front of the queue system's own pool."""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from qworker.backends.connections import open_sink, open_source
from qworker.bench.command import _build_systems
from qworker.bench.gateway_http import GatewayHttpSystem
from qworker.bench.queue_client import QueueClientSystem
from qworker.bench.records import RequestStatus
from qworker.bench.registry import BenchSettings, parse_systems
from qworker.bench.run_loop import run_system, warm_up
from qworker.bench.workload import generate_requests, parse_workload
from qworker.gateway.app import create_app
from qworker.gateway.settings import GatewaySettings
from qworker.testing.fake_engine import VOCAB_SIZE, FakeEngine
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.gateway.conftest import serve_app

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def gateway_pool():
    """A FakeEngine worker on a memory:// queue and a gateway app in front of it, both here."""
    url = f"memory://bench-http-{uuid.uuid4().hex[:8]}"
    worker = Worker(
        FakeEngine(max_model_len=256),
        open_source(url, consumer="fake-1"),
        open_sink(url),
        WorkerSettings(name="fake-1", poll_interval_s=0.02, cancel_check_interval_s=0.02),
    )
    thread = threading.Thread(target=worker.run, name="fake-worker", daemon=True)
    thread.start()
    app = create_app(GatewaySettings(model="fake", max_model_len=256, request_timeout_s=20), queue=url)
    try:
        with serve_app(app) as served:
            yield url, served.url
    finally:
        worker.stop()
        thread.join(timeout=10)


def test_streaming_requests_through_the_gateway(gateway_pool, tmp_path) -> None:
    url, gateway_url = gateway_pool
    pool = QueueClientSystem("qworker", url, tmp_path, "fake", "float32", "cpu", spawn_worker=False)
    system = GatewayHttpSystem("qworker", pool, tmp_path, shares_pool=False, gateway_url=gateway_url)
    spec = parse_workload(
        {
            "name": "tiny",
            "num_requests": 6,
            "arrival": {"process": "all_at_once"},
            "prompt_len": {"dist": "uniform", "min": 3, "max": 20},
            "output_len": {"dist": "uniform", "min": 2, "max": 9},
            "seed": 5,
        }
    )
    requests = generate_requests(spec, VOCAB_SIZE)
    # One the gateway refuses (prompt + max_tokens past the 256-token context): a 400.
    too_long = replace(requests[0], request_id="too-long", index=len(requests), output_len=1000)
    system.prepare()
    try:
        warm_up(system)
        result = run_system(system, [*requests, too_long], max_concurrency=3)
    finally:
        system.close()
    by_id = {r.request_id: r for r in requests}
    records = {r.request_id: r for r in result.records}
    refused = records.pop("too-long")
    assert refused.status is RequestStatus.FAILED and "HTTP 400" in (refused.error or ""), refused
    for record in records.values():
        assert record.status is RequestStatus.COMPLETED, record.error
        assert record.num_output_tokens == by_id[record.request_id].output_len
        # FakeEngine's letters stream as deltas; a chunk may carry several of them.
        assert 1 <= len(record.chunk_times) <= record.output_len
        assert record.chunk_times == sorted(record.chunk_times)
        assert record.arrival_time < record.chunk_times[0] <= record.finish_time
    assert result.meta["finish_reasons"] == {"length": len(requests)}
    assert result.meta["gateway_url"] == gateway_url


def test_queue_and_http_modes_share_one_pool(tmp_path: Path) -> None:
    """--mode http,queue: the queue system first, the http one in front of its worker."""
    specs = parse_systems("qworker,qworker:block_size=32")
    systems, notes = _build_systems(specs, ["http", "queue"], BenchSettings(), tmp_path, None, True)
    assert [(s.label, s.mode) for s in systems] == [
        ("qworker", "queue"),
        ("qworker:block_size=32", "queue"),
        ("qworker", "http"),
        ("qworker:block_size=32", "http"),
    ]
    for http in systems[2:]:
        assert isinstance(http, GatewayHttpSystem) and http.shares_pool
        assert http.pool is next(s for s in systems[:2] if s.label == http.label)
    [alone] = _build_systems(specs[:1], ["http"], BenchSettings(), tmp_path, None, True)[0]
    assert isinstance(alone, GatewayHttpSystem) and not alone.shares_pool
    assert notes == []
