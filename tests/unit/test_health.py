"""The worker's HTTP endpoints over real HTTP on 127.0.0.1, and the metrics they serve."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qworker.engine.block_pool import KVCacheStats
from qworker.health import HealthServer, HealthState
from qworker.jobs.job import JobError, JobResult, JobStatus, Timings, Usage
from qworker.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.timeout(30)


def _get(server: HealthServer, path: str) -> tuple[int, str, str]:
    url = f"http://127.0.0.1:{server.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.fixture
def served():
    metrics = WorkerMetrics()
    state = HealthState(stall_timeout_s=0.3)
    with HealthServer(metrics.registry, state, host="127.0.0.1", port=0) as server:
        yield metrics, state, server


def test_readiness_follows_start_ready_and_drain(served):
    _, state, server = served
    assert _get(server, "/readyz")[:1] == (503,)
    assert "starting" in _get(server, "/readyz")[2]
    state.set_ready(True)
    assert _get(server, "/readyz")[0] == 200
    state.set_draining()
    status, _, body = _get(server, "/readyz")
    assert (status, body.strip()) == (503, "draining")
    # A drain is for good, whatever else is set afterwards.
    state.set_ready(True)
    assert _get(server, "/readyz")[0] == 503


def test_liveness_fails_only_when_the_started_loop_stops_ticking(served):
    _, state, server = served
    # Loading the model: no tick yet, and alive.
    assert _get(server, "/healthz")[0] == 200
    state.tick()
    assert _get(server, "/healthz")[0] == 200
    time.sleep(0.5)
    status, _, body = _get(server, "/healthz")
    assert status == 503 and "not ticked" in body
    state.tick()
    assert _get(server, "/healthz")[0] == 200


def test_metrics_endpoint_serves_prometheus_text_with_qworker_names(served):
    metrics, _, server = served
    metrics.set_info(model="tiny", dtype="float32", device="cpu")
    kv = KVCacheStats(
        block_size=16,
        num_total_blocks=100,
        num_free_blocks=75,
        num_used_blocks=25,
        num_tokens_stored=390,
        num_empty_slots=10,
    )
    metrics.set_engine_gauges(kv, num_running=3, num_waiting=2, num_held=6, headroom_blocks=60)
    enqueued = 1_000.0
    metrics.observe_prompt_tokens(12)
    metrics.observe_generated_tokens(3)
    metrics.observe_generated_tokens(2)
    metrics.observe_result(
        JobResult(
            id="a",
            status=JobStatus.COMPLETED,
            usage=Usage(prompt_tokens=12, completion_tokens=5),
            timings=Timings(
                enqueued_at=enqueued,
                started_at=enqueued + 0.5,
                first_token_at=enqueued + 0.7,
                finished_at=enqueued + 2.0,
            ),
        )
    )
    metrics.observe_result(
        JobResult(
            id="b",
            status=JobStatus.FAILED,
            error=JobError(type="ValidationError", message="x"),
            timings=Timings(enqueued_at=enqueued, finished_at=enqueued + 0.1),
        )
    )
    metrics.observe_dead_letter("DeadLettered")
    metrics.observe_lease_lost()
    metrics.observe_itl(0.03)

    status, content_type, body = _get(server, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    samples = _samples(body)
    assert samples[("qworker_jobs_total", (("status", "completed"),))] == 1
    assert samples[("qworker_jobs_total", (("status", "failed"),))] == 1
    assert samples[("qworker_jobs_total", (("status", "cancelled"),))] == 0
    assert samples[("qworker_prompt_tokens_total", ())] == 12
    assert samples[("qworker_generation_tokens_total", ())] == 5
    assert samples[("qworker_dead_lettered_jobs_total", (("reason", "DeadLettered"),))] == 1
    assert samples[("qworker_leases_lost_total", ())] == 1
    assert samples[("qworker_kv_cache_total_blocks", ())] == 100
    assert samples[("qworker_kv_cache_free_blocks", ())] == 75
    assert samples[("qworker_kv_cache_usage_ratio", ())] == 0.25
    assert samples[("qworker_requests_running", ())] == 3
    assert samples[("qworker_requests_waiting", ())] == 2
    assert samples[("qworker_jobs_held", ())] == 6
    assert samples[("qworker_admission_headroom_blocks", ())] == 60
    assert samples[("qworker_queue_wait_seconds_count", ())] == 1
    assert samples[("qworker_queue_wait_seconds_sum", ())] == pytest.approx(0.5)
    assert samples[("qworker_time_to_first_token_seconds_count", ())] == 1
    # Both results reached the store, so both have an end-to-end latency.
    assert samples[("qworker_e2e_latency_seconds_count", ())] == 2
    assert samples[("qworker_inter_token_latency_seconds_count", ())] == 1
    info = [(dict(lab), v) for (name, lab), v in samples.items() if name == "qworker_worker_info"]
    ((labels, value),) = info
    assert value == 1
    assert {labels["model"], labels["dtype"], labels["device"]} == {"tiny", "float32", "cpu"}
    assert labels["version"]
    for family in text_string_to_metric_families(body):
        assert family.name.startswith("qworker_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)


def test_two_servers_in_one_process_keep_their_own_metrics_and_state():
    a, b = WorkerMetrics(), WorkerMetrics()
    state_a, state_b = HealthState(), HealthState()
    with (
        HealthServer(a.registry, state_a, host="127.0.0.1") as server_a,
        HealthServer(b.registry, state_b, host="127.0.0.1") as server_b,
    ):
        a.observe_lease_lost(3)
        state_a.set_ready(True)
        assert _get(server_a, "/readyz")[0] == 200 and _get(server_b, "/readyz")[0] == 503
        assert _samples(_get(server_a, "/metrics")[2])[("qworker_leases_lost_total", ())] == 3
        assert _samples(_get(server_b, "/metrics")[2])[("qworker_leases_lost_total", ())] == 0
        assert _get(server_a, "/nope")[0] == 404


def test_a_slow_scrape_does_not_block_a_probe(served):
    """Threaded: a probe is answered while another connection sits idle on the server."""
    _, state, server = served
    state.set_ready(True)
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        idle.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finished
        results = []
        probe = threading.Thread(target=lambda: results.append(_get(server, "/readyz")[0]))
        probe.start()
        probe.join(timeout=5)
        assert results == [200]
