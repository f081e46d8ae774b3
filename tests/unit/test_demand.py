"""The pool-demand formula and the job-size estimates (pure functions)."""

from __future__ import annotations

import json

import pytest

from qworker.backends.backlog import parse_worker_report
from qworker.backends.celery.backlog import celery_envelope_blocks
from qworker.pool.demand import (
    MESSAGE_OVERHEAD_TOKENS,
    PoolSizing,
    Work,
    body_blocks,
    desired_workers,
    estimate_job_tokens,
    extrapolate,
    job_blocks,
    pool_demand,
)

pytestmark = pytest.mark.timeout(30)

SIZING = PoolSizing(capacity_blocks=100, block_size=16, target_utilization=0.5)


def test_job_blocks_round_up_and_never_reach_zero():
    assert job_blocks(16, 0, 16) == 1
    assert job_blocks(16, 1, 16) == 2
    assert job_blocks(0, 0, 16) == 1


def test_token_estimates_per_prompt_form():
    assert estimate_job_tokens({"prompt_token_ids": [1] * 37, "params": {"max_tokens": 5}}, SIZING) == (37, 5)
    assert estimate_job_tokens({"prompt": "x" * 401}, SIZING) == (101, SIZING.default_max_tokens)
    messages = [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "y" * 8}]
    assert estimate_job_tokens({"messages": messages, "params": {"max_tokens": 64}}, SIZING) == (
        10 + 2 + 2 * MESSAGE_OVERHEAD_TOKENS,
        64,
    )
    # A bad max_tokens does not break the estimate: the worker will fail the job, quickly.
    assert estimate_job_tokens({"prompt": "abcd", "params": {"max_tokens": "many"}}, SIZING)[1] == 16


def test_unreadable_bodies_count_one_block():
    assert body_blocks(b"\xff\xfe not json", SIZING) == 1
    assert body_blocks(b"[1, 2]", SIZING) == 1
    assert body_blocks(json.dumps({"prompt_token_ids": [1] * 40, "params": {"max_tokens": 40}}), SIZING) == 5


def test_pooling_jobs_count_their_prompt_blocks_only():
    # Each input is its own prefill-only sequence: 40 ids -> 3 blocks, 16 -> 1; no max_tokens.
    ids_job = {"task": "embed", "input": [[1] * 40, [2] * 16], "params": {"max_tokens": 500}}
    assert body_blocks(json.dumps(ids_job), SIZING) == 4
    assert body_blocks(json.dumps({"task": "embed", "input": [1] * 40}), SIZING) == 3
    text_chars = int(SIZING.chars_per_token * 20)
    assert body_blocks(json.dumps({"task": "classify", "input": "x" * text_chars}), SIZING) == 2
    score_job = {"task": "score", "query": "q" * text_chars, "documents": ["d" * text_chars] * 3}
    assert body_blocks(json.dumps(score_job), SIZING) == 3 * 3
    assert body_blocks(json.dumps({"task": "embed", "input": []}), SIZING) == 1


def test_desired_workers_rule():
    # capacity 100 blocks at 50%: 50 blocks per worker.
    assert desired_workers(0, 100, 0.5, is_waiting=False) == 0
    assert desired_workers(1, 100, 0.5, is_waiting=True) == 1
    assert desired_workers(50, 100, 0.5, is_waiting=True) == 1
    assert desired_workers(51, 100, 0.5, is_waiting=True) == 2
    assert desired_workers(400, 100, 0.5, is_waiting=False) == 8


def test_pool_demand_is_zero_only_without_any_job():
    assert pool_demand(Work(), Work(), SIZING).desired_workers == 0
    assert pool_demand(Work(1, 1), Work(), SIZING).desired_workers == 1
    assert pool_demand(Work(), Work(3, 120), SIZING).desired_workers == 3
    demand = pool_demand(Work(10, 80), Work(5, 70), SIZING)
    assert (demand.demand_blocks, demand.desired_workers, demand.capacity_blocks) == (150, 3, 100)


def test_extrapolate_from_a_sample():
    assert extrapolate([2, 4], 2, SIZING) == Work(2, 6)
    assert extrapolate([2, 4], 10, SIZING) == Work(10, 30)
    # Nothing read: the configured mean (512 tokens = 32 blocks of 16).
    assert extrapolate([], 3, SIZING) == Work(3, 96)
    assert extrapolate([5], 0, SIZING) == Work()


def test_sizing_rejects_nonsense():
    with pytest.raises(ValueError, match="target_utilization"):
        PoolSizing(capacity_blocks=10, target_utilization=0)
    with pytest.raises(ValueError, match="capacity_blocks"):
        PoolSizing(capacity_blocks=0)


def test_worker_report_from_stats_json():
    admission = {
        "num_total_blocks": 100,
        "num_free_blocks": 60,
        "num_reserved_blocks": 3,
        "num_committed_blocks": 7,
        "num_headroom_blocks": 50,
        "num_jobs_held": 4,
        "num_jobs_not_started": 1,
        "num_jobs_to_pull": 0,
    }
    report = parse_worker_report("w", {"admission": admission, "num_completed": 3})
    # Without num_demand_blocks: used + committed + reserved, a lower bound.
    assert (report.num_kv_blocks, report.num_demand_blocks, report.num_jobs_held) == (100, 50, 4)
    report = parse_worker_report("w", {"admission": {**admission, "num_demand_blocks": 77}})
    assert report.num_demand_blocks == 77
    assert parse_worker_report("w", {"admission": None}) is None


def test_celery_envelope_sizes_its_kwargs_job():
    import base64

    body = json.dumps([[], {"prompt_token_ids": [1] * 30, "params": {"max_tokens": 2}}, {}]).encode()
    envelope = json.dumps(
        {"body": base64.b64encode(body).decode(), "properties": {"body_encoding": "base64"}}
    )
    assert celery_envelope_blocks(envelope, SIZING) == 2
    # kombu's unacked hash keeps [envelope, exchange, routing_key].
    assert celery_envelope_blocks(json.dumps([json.loads(envelope), "qworker", "qworker"]), SIZING) == 2
    assert celery_envelope_blocks(b"garbage", SIZING) == 1


def test_without_a_known_capacity_any_job_asks_for_one_worker():
    sizing = PoolSizing(capacity_blocks=None)
    assert pool_demand(Work(), Work(), sizing).desired_workers == 0
    unknown = pool_demand(Work(50, 5000), Work(), sizing)
    assert (unknown.capacity_blocks, unknown.desired_workers) == (None, 1)
    # Once a worker reported its pool (100 blocks, at 80%): 5000 / 80.
    reported = pool_demand(Work(50, 5000), Work(), sizing, capacity_blocks=100)
    assert (reported.capacity_blocks, reported.desired_workers) == (100, 63)
    # A configured capacity wins over a reported one.
    assert (
        pool_demand(Work(1, 10), Work(), PoolSizing(capacity_blocks=5), capacity_blocks=100).capacity_blocks
        == 5
    )
