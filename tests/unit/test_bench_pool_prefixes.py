"""The pool-prefixes workload (P distinct prefixes, interleaved) and the pool's ideal computed
prompt tokens (qworker/bench/pool_stats.py): pure, no model."""

from __future__ import annotations

import pytest

from qworker.bench.pool_stats import ideal_computed_prompt_tokens, pool_summary
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.workload import WorkloadError, generate_requests, load_workload, parse_workload

pytestmark = pytest.mark.timeout(30)

VOCAB = 49152


def test_pool_prefixes_interleaves_distinct_prefixes_and_its_ideal_is_each_prefix_once() -> None:
    spec = load_workload("pool-prefixes")
    requests = generate_requests(spec, VOCAB)
    p, n = spec.num_prefixes, spec.shared_prefix_len
    assert len(requests) == spec.num_requests and p == 8 and n == 1024
    prefixes = [tuple(r.prompt_token_ids[:n]) for r in requests]
    assert len(set(prefixes)) == p
    assert all(prefixes[i] == prefixes[i % p] for i in range(len(requests)))
    suffixes = sum(r.prompt_len - n for r in requests)
    assert ideal_computed_prompt_tokens(requests) == p * n + suffixes


def test_one_prefix_specs_keep_their_requests_and_share_nothing_means_every_token() -> None:
    base = {
        "name": "t",
        "num_requests": 6,
        "prompt_len": {"dist": "uniform", "min": 20, "max": 40},
        "output_len": 4,
    }
    one = generate_requests(parse_workload({**base, "shared_prefix_len": 32}), VOCAB)
    two = generate_requests(parse_workload({**base, "shared_prefix_len": 32, "num_prefixes": 2}), VOCAB)
    # The first prefix is the one a single-prefix spec draws; odd requests get the second.
    assert [r.prompt_token_ids for r in one[::2]] == [r.prompt_token_ids for r in two[::2]]
    assert one[1].prompt_token_ids[:32] != two[1].prompt_token_ids[:32]
    plain = generate_requests(parse_workload(base), VOCAB)
    assert ideal_computed_prompt_tokens(plain) == sum(r.prompt_len for r in plain)
    with pytest.raises(WorkloadError, match="shared_prefix_len"):
        parse_workload({**base, "num_prefixes": 2})


def test_a_prompt_held_whole_still_computes_its_last_token() -> None:
    from qworker.bench.workload import BenchRequest

    ids = list(range(100, 132))  # two whole blocks
    requests = [BenchRequest(f"r{i}", i, list(ids), 4, arrival_s=float(i)) for i in range(3)]
    assert ideal_computed_prompt_tokens(requests) == 32 + 1 + 1


def test_pool_summary_counts_per_worker() -> None:
    records = []
    for i, (worker, cached) in enumerate([("a", 0), ("a", 1024), ("b", 0), ("b", 1000)]):
        r = RequestRecord(f"r{i}", 1056, 16, 0.0, num_cached_tokens=cached, worker=worker)
        r.finish(RequestStatus.COMPLETED, 1.0)
        records.append(r)
    summary = pool_summary(records, ideal_computed=2112)
    assert summary is not None
    assert summary["prompt_tokens_computed"] == 4 * 1056 - 2024
    assert summary["workers"]["a"]["hit_rate"] == pytest.approx(1024 / 2112)
    assert summary["computed_over_ideal"] == pytest.approx((4 * 1056 - 2024) / 2112)
    assert pool_summary([RequestRecord("x", 4, 4, 0.0)]) is None
