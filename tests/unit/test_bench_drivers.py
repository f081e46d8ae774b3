"""The run loop with each system's hooks, on tiny random models: every request accounted for,
static admission and static batching behave as specified, limits turn into counted timeouts."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from qworker.bench.hf_generate import HFGenerateSystem
from qworker.bench.qworker_engine import QworkerEngineSystem
from qworker.bench.records import RequestStatus
from qworker.bench.run import RunLimits, RunResult
from qworker.bench.run_loop import run_system, warm_up
from qworker.bench.workload import BenchRequest, generate_requests, parse_workload
from qworker.config import EngineConfig
from qworker.testing.tiny_model import TINY_LLAMA
from tests.conftest import tiny_engine

pytestmark = pytest.mark.timeout(240)

VOCAB = TINY_LLAMA["vocab_size"]


def workload(n: int = 6, **arrival: object) -> list[BenchRequest]:
    spec = parse_workload(
        {
            "name": "tiny",
            "num_requests": n,
            "arrival": arrival or {"process": "all_at_once"},
            "prompt_len": {"dist": "uniform", "min": 3, "max": 20},
            "output_len": {"dist": "uniform", "min": 2, "max": 9},
            "seed": 5,
        }
    )
    return generate_requests(spec, VOCAB)


def qworker_system(tiny_llama, static_batch_size: int | None = None) -> QworkerEngineSystem:
    engine = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    system = QworkerEngineSystem("qworker", EngineConfig(model="tiny"), static_batch_size, engine=engine)
    system.prepare()
    warm_up(system)
    return system


def hf_system(tiny_llama, batch_size: int) -> HFGenerateSystem:
    system = HFGenerateSystem("hf", None, batch_size, dtype=torch.float32, model=tiny_llama, pad_token_id=0)
    system.prepare()
    warm_up(system)
    return system


def run(system, requests, max_concurrency=None, limits: RunLimits | None = None, **kwargs) -> RunResult:
    ticks: list[int] = []
    result = run_system(system, requests, max_concurrency, limits, ticks.append, **kwargs)
    assert len(result.records) == len(requests)
    assert sum(ticks) == len(requests), "the progress bar must reach the total"
    assert {r.request_id for r in result.records} == {r.request_id for r in requests}
    assert all(r.status is not None for r in result.records)
    return result


def assert_all_completed(result: RunResult, requests: list[BenchRequest]) -> None:
    by_id = {r.request_id: r for r in requests}
    for record in result.records:
        assert record.status is RequestStatus.COMPLETED, record.error
        assert record.num_output_tokens == by_id[record.request_id].output_len
        assert len(record.chunk_times) == record.output_len
        assert record.chunk_times == sorted(record.chunk_times)
        assert record.arrival_time <= record.chunk_times[0] <= record.finish_time


def test_qworker_continuous(tiny_llama) -> None:
    requests = workload()
    result = run(qworker_system(tiny_llama), requests)
    assert_all_completed(result, requests)
    assert result.kv_samples and result.num_preemptions == 0
    # Continuous batching: every request is in the engine from the first step.
    assert max(s.num_running + s.num_waiting for s in result.kv_samples) == len(requests)
    for s in result.kv_samples:
        assert s.num_empty_slots == s.num_used_blocks * s.block_size - s.num_tokens_stored


def test_qworker_static_admission_waits_for_the_batch_to_drain(tiny_llama) -> None:
    requests = workload()
    result = run(qworker_system(tiny_llama, static_batch_size=2), requests)
    assert_all_completed(result, requests)
    assert max(s.num_running + s.num_waiting for s in result.kv_samples) == 2
    # Batches in arrival order: the next one's first token comes after the previous one's last.
    by_id = {r.request_id: r for r in result.records}
    batches = [[by_id[r.request_id] for r in requests[i : i + 2]] for i in range(0, len(requests), 2)]
    for earlier, later in itertools.pairwise(batches):
        assert max(r.finish_time for r in earlier) <= min(r.chunk_times[0] for r in later)


def test_qworker_concurrency_cap(tiny_llama) -> None:
    requests = workload()
    result = run(qworker_system(tiny_llama), requests, max_concurrency=2)
    assert_all_completed(result, requests)
    assert max(s.num_running + s.num_waiting for s in result.kv_samples) <= 2


def test_hf_static_batches_run_to_their_longest_request(tiny_llama) -> None:
    requests = workload()
    result = run(hf_system(tiny_llama, batch_size=3), requests)
    assert_all_completed(result, requests)
    assert result.meta["num_batches"] == 2
    by_id = {r.request_id: r for r in result.records}
    for i in (0, 3):
        batch = [by_id[r.request_id] for r in requests[i : i + 3]]
        # Every request of a batch finishes when the batch does, whatever its own length.
        assert len({r.finish_time for r in batch}) == 1
        assert len({r.start_time for r in batch}) == 1
        # Token times are the batch's step times: the k-th token of each row at the same time.
        assert len({r.chunk_times[0] for r in batch}) == 1


def test_hf_sequential_runs_one_at_a_time(tiny_llama) -> None:
    requests = workload(4)
    result = run(hf_system(tiny_llama, batch_size=1), requests)
    assert_all_completed(result, requests)
    assert result.meta["num_batches"] == 4
    ordered = sorted(result.records, key=lambda r: r.start_time)
    for earlier, later in itertools.pairwise(ordered):
        assert earlier.finish_time <= later.start_time


def test_hf_static_cannot_start_a_batch_before_its_requests_arrive(tiny_llama) -> None:
    requests = workload(3)
    requests = [replace(r, arrival_s=a) for r, a in zip(requests, (0.0, 0.0, 0.3), strict=True)]
    result = run(hf_system(tiny_llama, batch_size=8), requests)
    assert_all_completed(result, requests)
    by_id = {r.request_id: r for r in result.records}
    late = by_id[requests[2].request_id]
    assert all(r.start_time >= r.arrival_time for r in result.records)
    assert late.start_time > by_id[requests[0].request_id].start_time
    assert result.meta["num_batches"] == 2


@pytest.mark.parametrize("kind", ["qworker", "hf"])
def test_run_deadline_counts_everything_left_as_timeouts(tiny_llama, kind: str) -> None:
    system = qworker_system(tiny_llama) if kind == "qworker" else hf_system(tiny_llama, 4)
    requests = workload()
    result = run(system, requests, limits=RunLimits(drain_timeout_s=0.0))
    assert all(r.status is RequestStatus.TIMEOUT for r in result.records)
    assert all(r.error for r in result.records)


def test_request_timeout_aborts_in_the_engine(tiny_llama) -> None:
    system = qworker_system(tiny_llama)
    requests = workload()
    result = run(system, requests, limits=RunLimits(request_timeout_s=1e-9))
    assert all(r.status is RequestStatus.TIMEOUT for r in result.records)
    assert not system.engine.has_unfinished_requests()


def test_invalid_request_is_a_counted_failure(tiny_llama) -> None:
    requests = workload(3)
    # A prompt longer than the tiny model's context (512) fails in add_request, not the run.
    requests[1] = replace(requests[1], prompt_token_ids=[40] * 600)
    result = run(qworker_system(tiny_llama), requests)
    statuses = {r.request_id: r.status for r in result.records}
    assert statuses[requests[1].request_id] is RequestStatus.FAILED
    assert sum(s is RequestStatus.COMPLETED for s in statuses.values()) == 2


def test_queue_results_only_beside_an_in_process_worker(tiny_llama, tmp_path) -> None:
    """scripts/bench_queue.py's queue mode: the worker on this thread, the run loop beside it
    submitting jobs at their send times and reading results in submit order, through Redis."""
    pytest.importorskip("redis")
    from qworker.backends.connections import open_sink, open_source
    from qworker.bench.queue_client import QueueClientSystem
    from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
    from qworker.worker.loop import Worker, run_beside
    from qworker.worker.settings import WorkerSettings

    engine = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    url = unique_url(redis_base_url(), tag="bench-drivers")
    worker = Worker(
        engine, open_source(url, consumer="t"), open_sink(url), WorkerSettings(name="t", max_backlog=4)
    )
    system = QueueClientSystem(
        "queue", url, tmp_path, "tiny", "float32", "cpu", spawn_worker=False, stream=False
    )
    requests = workload()

    def client_side() -> RunResult:
        system.prepare()
        warm_up(system)
        return run(system, requests, max_concurrency=3)

    try:
        result = run_beside(worker, client_side)
    finally:
        cleanup(system.client.producer.redis, url)  # after the worker stopped reading the stream
        system.close()
    by_id = {r.request_id: r for r in requests}
    for record in result.records:
        assert record.status is RequestStatus.COMPLETED, record.error
        assert record.num_output_tokens == by_id[record.request_id].output_len
        assert record.queue_wait_s is not None and record.chunk_times == []
    assert result.meta["url"] == url


def test_token_ids_kept_and_equal_across_systems(tiny_llama) -> None:
    """keep_token_ids: the engine's greedy tokens equal transformers' one-at-a-time generate."""
    requests = workload(4)
    engine_run = run(qworker_system(tiny_llama), requests, keep_token_ids=True)
    hf_run = run(hf_system(tiny_llama, batch_size=1), requests, keep_token_ids=True)
    assert engine_run.token_ids == hf_run.token_ids
    assert [len(engine_run.token_ids[r.request_id]) for r in requests] == [r.output_len for r in requests]


def test_a_completion_past_the_request_timeout_counts_as_a_timeout(tiny_llama) -> None:
    """hf-static finishes a whole batch at once: its requests that took longer than the request
    timeout are timeouts, whatever the system reported."""
    requests = workload(3)
    result = run(hf_system(tiny_llama, batch_size=3), requests, limits=RunLimits(request_timeout_s=1e-6))
    assert all(r.status is RequestStatus.TIMEOUT for r in result.records)
    assert all("request timeout" in r.error for r in result.records)


def test_a_failed_warm_up_raises(tiny_llama) -> None:
    system = qworker_system(tiny_llama)
    too_long = replace(workload(1)[0], prompt_token_ids=[40] * 600)
    with pytest.raises(RuntimeError, match="warm-up request"):
        warm_up(system, requests=[too_long])
