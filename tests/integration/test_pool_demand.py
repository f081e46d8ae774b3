"""The pool-demand signal read from real queues: Redis Streams and Celery on the suite's Redis
server (tests/conftest.py), SQS on moto's server. Jobs go in through qworker's own
producers, leases are taken by qworker's own sources, worker reports written by its Redis sink."""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid

import pytest
import redis as redis_lib
from prometheus_client.parser import text_string_to_metric_families

from qworker.backends.connections import (
    SINK_PARAMS,
    SOURCE_PARAMS,
    open_producer,
    open_sink,
    open_source,
    parse_url,
)
from qworker.backends.source import OutgoingJob
from qworker.pool.demand import PoolDemand, PoolSizing
from qworker.pool.exporter import (
    PoolDemandReader,
    open_backlog,
    open_pool_demand_reader,
    run_metrics_exporter,
)
from qworker.testing.worker_kit import cleanup, redis_base_url, unique_url
from qworker.worker.admission import AdmissionPolicy, HeldJobSize
from qworker.worker.loop import WorkerStats

pytestmark = pytest.mark.timeout(120)

# 16 blocks per worker (capacity 16 at full utilisation): a worker count is demand / 16.
SIZING = PoolSizing(capacity_blocks=16, block_size=16, target_utilization=1.0)


def token_job(num_tokens: int) -> bytes:
    """A job that reaches exactly `num_tokens` tokens (prompt + max_tokens)."""
    return json.dumps({"prompt_token_ids": [5] * (num_tokens - 4), "params": {"max_tokens": 4}}).encode()


def send(url: str, bodies: list[bytes]) -> None:
    producer = open_producer(url)
    try:
        producer.send([OutgoingJob(uuid.uuid4().hex, body) for body in bodies])
    finally:
        producer.close()


def redis_url_for(url: str) -> str:
    return parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url


@pytest.fixture
def new_url():
    made = []

    def make() -> str:
        made.append(unique_url(redis_base_url(), tag="demand"))
        return made[-1]

    yield make
    for url in made:
        cleanup(redis_lib.Redis.from_url(redis_url_for(url)), url)


def read(url: str, sizing: PoolSizing = SIZING, **kwargs) -> PoolDemand:
    reader = open_pool_demand_reader(url, sizing, **kwargs)
    try:
        return reader.read()
    finally:
        reader.close()


# -- Redis Streams ---------------------------------------------------------------------------


def test_redis_eight_times_the_tokens_gives_eight_times_the_workers(new_url):
    small, large = new_url(), new_url()
    send(small, [token_job(64)] * 16)  # 4 blocks each: 64 blocks
    send(large, [token_job(512)] * 16)  # 32 blocks each: 512 blocks
    a, b = read(small), read(large)
    assert (a.waiting.num_jobs, b.waiting.num_jobs) == (16, 16)
    assert (a.demand_blocks, b.demand_blocks) == (64, 512)
    assert (a.desired_workers, b.desired_workers) == (4, 32)


def test_redis_same_tokens_in_different_job_counts_give_the_same_workers(new_url):
    few, many = new_url(), new_url()
    send(few, [token_job(512)] * 8)  # 8 x 32 blocks
    send(many, [token_job(64)] * 64)  # 64 x 4 blocks
    a, b = read(few), read(many)
    assert (a.waiting.num_jobs, b.waiting.num_jobs) == (8, 64)
    assert a.demand_blocks == b.demand_blocks == 256
    assert a.desired_workers == b.desired_workers == 16


def test_redis_empty_queue_gives_zero_and_one_tiny_job_gives_one(new_url):
    url = new_url()
    assert read(url).desired_workers == 0  # the stream does not even exist
    send(url, [])
    assert read(url).desired_workers == 0
    send(url, [json.dumps({"prompt": "hi", "params": {"max_tokens": 1}}).encode()])
    demand = read(url, PoolSizing(capacity_blocks=10_000))
    assert (demand.waiting.num_jobs, demand.desired_workers) == (1, 1)


def test_redis_text_prompts_are_sized_by_length(new_url):
    url = new_url()
    # 4 chars per token: 1020 tokens + 4 = 1024 tokens = 64 blocks.
    send(url, [json.dumps({"prompt": "x" * 4080, "params": {"max_tokens": 4}}).encode()] * 2)
    assert read(url).demand_blocks == 128


def test_redis_sampled_bodies_extrapolate_to_the_whole_stream(new_url):
    url = new_url()
    send(url, [token_job(64)] * 40)
    reader = open_pool_demand_reader(url, SIZING)
    reader.backlog.sample_limit = 5
    try:
        demand = reader.read()
    finally:
        reader.close()
    assert (demand.waiting.num_jobs, demand.demand_blocks) == (40, 160)


def _write_report(url: str, worker_name: str, held: list[HeldJobSize]) -> None:
    policy = AdmissionPolicy(block_size=16, max_backlog=8, reserve_blocks_per_seq=1, max_jobs_held=64)
    admission = policy.decide(num_total_blocks=16, num_free_blocks=8, jobs=held)
    sink = open_sink(url)
    try:
        sink.write_worker_stats(worker_name, WorkerStats(admission=admission))
    finally:
        sink.close()


def test_redis_jobs_held_by_a_live_worker_count_as_running_from_its_report(new_url):
    url = new_url()
    send(url, [token_job(64)] * 10)
    source = open_source(url, consumer="w1", lease_timeout_s=30)
    try:
        assert len(source.lease(4, 0.0)) == 4
        # No report store: the held entries count as in flight, sized from their bodies.
        reader = PoolDemandReader(open_backlog(url, SIZING), SIZING, stats_redis=None)
        try:
            no_store = reader.read()
        finally:
            reader.close()
        assert (no_store.waiting.num_jobs, no_store.running.num_jobs) == (6, 4)
        assert no_store.running.num_blocks == 16

        # A store without w1's report: w1 is not live, its 4 entries wait again.
        demand = read(url)
        assert (demand.waiting.num_jobs, demand.running.num_jobs) == (10, 0)
        assert demand.demand_blocks == 40

        # w1 reports: its entries are running, with the demand its report gives.
        _write_report(url, "w1", [HeldJobSize(60, 4, 1, True)] * 4)
        demand = read(url)
        assert (demand.waiting.num_jobs, demand.running.num_jobs) == (6, 4)
        assert demand.waiting.num_blocks == 24
        assert demand.running.num_blocks > 0
        assert demand.desired_workers >= 2
    finally:
        source.close()


def test_redis_capacity_from_the_workers_reports_when_none_is_configured(new_url):
    url = new_url()
    send(url, [token_job(512)] * 4)  # 128 blocks
    unsized = PoolSizing(capacity_blocks=None, target_utilization=1.0)
    assert read(url, unsized).desired_workers == 1  # nobody reported a pool yet
    _write_report(url, "w1", [])  # a 16-block pool
    demand = read(url, unsized)
    assert (demand.capacity_blocks, demand.desired_workers) == (16, 8)


def test_redis_released_entries_wait_again_even_under_a_live_worker(new_url):
    url = new_url()
    send(url, [token_job(64)] * 3)
    source = open_source(url, consumer="w1", lease_timeout_s=30)
    try:
        leases = source.lease(3, 0.0)
        _write_report(url, "w1", [])
        source.release(leases[:2])  # a drain gives them back: idle past the lease at once
        demand = read(url)
        assert (demand.waiting.num_jobs, demand.running.num_jobs) == (2, 0)
        assert demand.waiting.num_blocks == 8
    finally:
        source.close()


# -- Celery on Redis -------------------------------------------------------------------------


def test_celery_queue_waiting_and_unacked_jobs(new_url):
    name = f"qwtest-demand-{uuid.uuid4().hex[:8]}"
    url = f"celery+{redis_base_url()}?queue={name}"
    try:
        send(url, [token_job(64)] * 6 + [token_job(512)] * 2)
        demand = read(url)
        assert (demand.waiting.num_jobs, demand.demand_blocks) == (8, 6 * 4 + 2 * 32)
        source = open_source(url, consumer="c1", lease_timeout_s=30)
        try:
            assert len(source.lease(3, 0.0)) == 3
            demand = read(url)
            assert demand.waiting.num_jobs + demand.running.num_jobs == 8
            assert demand.running.num_jobs == 3 and demand.demand_blocks == 6 * 4 + 2 * 32
        finally:
            source.close()
    finally:
        r = redis_lib.Redis.from_url(redis_base_url())
        keys = list(r.scan_iter(match=f"{name}*")) + list(r.scan_iter(match=f"_kombu.binding.{name}*"))
        if keys:
            r.delete(*keys)


# -- SQS on moto -----------------------------------------------------------------------------


def test_sqs_counts_messages_at_the_configured_mean(sqs_s3):
    q = sqs_s3()
    small = PoolSizing(capacity_blocks=16, block_size=16, target_utilization=1.0, mean_job_tokens=64)
    large = PoolSizing(capacity_blocks=16, block_size=16, target_utilization=1.0, mean_job_tokens=512)
    assert read(q.queue_url, small).desired_workers == 0
    send(q.queue_url, [token_job(64)] * 16)
    a, b = read(q.queue_url, small), read(q.queue_url, large)
    assert a.waiting.num_jobs == b.waiting.num_jobs == 16
    # SQS shows no body before a receive: the job size is the configured (or reported) mean.
    assert (a.demand_blocks, b.demand_blocks) == (64, 512)
    assert (a.desired_workers, b.desired_workers) == (4, 32)

    source = open_source(q.queue_url, consumer="s1", lease_timeout_s=30)
    try:
        leases = []
        while len(leases) < 5:
            leases += source.lease(5 - len(leases), 1.0)
        demand = read(q.queue_url, small)
        assert (demand.waiting.num_jobs, demand.running.num_jobs) == (11, 5)
        assert demand.desired_workers == 4
    finally:
        source.close()


def test_sqs_one_waiting_job_gives_one_worker(sqs_s3):
    q = sqs_s3()
    send(q.queue_url, [token_job(8)])
    assert read(q.queue_url, PoolSizing(capacity_blocks=10_000)).desired_workers == 1


# -- the exporter over HTTP ------------------------------------------------------------------


def test_exporter_serves_the_signal_where_keda_reads_it(new_url):
    url = new_url()
    send(url, [token_job(512)] * 3)
    stop = threading.Event()
    serving = []
    thread = threading.Thread(
        target=run_metrics_exporter,
        args=(url, SIZING),
        kwargs={
            "host": "127.0.0.1",
            "port": 0,
            "interval_s": 0.1,
            "stop": stop,
            "on_serving": serving.append,
        },
        daemon=True,
    )
    thread.start()
    try:
        for _ in range(100):
            if serving:
                break
            threading.Event().wait(0.05)
        base = f"http://127.0.0.1:{serving[0].port}"
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"{base}/readyz", timeout=2) as response:
                    if response.status == 200:
                        break
            except urllib.error.HTTPError:
                threading.Event().wait(0.05)
        with urllib.request.urlopen(f"{base}/metrics", timeout=2) as response:
            text = response.read().decode()
        values = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        assert values["qworker_pool_demand_blocks"] == 96
        assert values["qworker_pool_desired_workers"] == 6
        assert values["qworker_pool_capacity_blocks"] == 16
        assert values["qworker_pool_waiting_jobs"] == 3
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
