"""Serving metrics on synthetic timestamp traces with answers worked out by hand."""

from __future__ import annotations

import pytest

from qworker.bench.kv_usage import KVSample, summarize_kv
from qworker.bench.metrics import SLOError, latency_stats, parse_slo, percentile_key, summarize
from qworker.bench.records import RequestRecord, RequestStatus

pytestmark = pytest.mark.timeout(30)


def record(
    request_id: str,
    arrival: float,
    chunks: list[float],
    status: RequestStatus,
    finish: float,
    prompt_len: int = 10,
    output_len: int | None = None,
) -> RequestRecord:
    r = RequestRecord(request_id, prompt_len, output_len if output_len is not None else len(chunks), arrival)
    for t in chunks:
        r.add_chunk(t)
    r.finish(status, finish, None if status is RequestStatus.COMPLETED else "boom")
    return r


def trace() -> list[RequestRecord]:
    return [
        # TTFT 0.5, ITLs 0.2 0.3 0.6, E2EL 1.6, TPOT (1.6 - 0.5) / 3
        record("a", 0.0, [0.5, 0.7, 1.0, 1.6], RequestStatus.COMPLETED, 1.6, prompt_len=100),
        # TTFT 0.2, ITL 0.1, E2EL 0.3, TPOT 0.1
        record("b", 1.0, [1.2, 1.3], RequestStatus.COMPLETED, 1.3, prompt_len=20),
        # failed before any token
        record("c", 1.5, [], RequestStatus.FAILED, 1.5, output_len=8),
        # timed out with partial output: counted, never in the latency statistics
        record("d", 0.0, [3.0, 3.5], RequestStatus.TIMEOUT, 4.0, output_len=50),
        # one token: TTFT 0.4, E2EL 0.4, no TPOT, no ITL
        record("e", 2.0, [2.4], RequestStatus.COMPLETED, 2.4, prompt_len=7),
    ]


def test_per_request_quantities() -> None:
    a, b, _, _, e = trace()
    assert a.ttft == pytest.approx(0.5)
    assert a.itls == pytest.approx([0.2, 0.3, 0.6])
    assert a.e2el == pytest.approx(1.6)
    assert a.tpot == pytest.approx(1.1 / 3)
    assert b.tpot == pytest.approx(0.1)
    assert e.tpot is None and e.itls == []


def test_counts_and_throughput() -> None:
    s = summarize(trace(), duration_s=4.0)
    assert s["num_prompts"] == 5
    assert s["completed"] == 3
    assert s["failed"] == 2  # vLLM's meaning: everything that did not complete
    assert s["timed_out"] == 1
    assert s["errored"] == 1
    assert s["total_input_tokens"] == 127  # completed requests only
    assert s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(1.75)
    assert s["total_token_throughput"] == pytest.approx(134 / 4)


def test_latency_statistics_and_percentiles() -> None:
    s = summarize(trace(), duration_s=4.0)
    # TTFT over a, b, e: [500, 200, 400] ms
    assert s["mean_ttft_ms"] == pytest.approx(1100 / 3)
    assert s["median_ttft_ms"] == pytest.approx(400)
    # Linear interpolation between closest ranks: sorted [200, 400, 500], rank 0.9 * 2 = 1.8.
    assert s["p90_ttft_ms"] == pytest.approx(480)
    assert s["p99_ttft_ms"] == pytest.approx(498)
    # ITL pooled over requests: [200, 300, 600, 100] ms; d's gap (500 ms) is not included.
    assert s["median_itl_ms"] == pytest.approx(250)
    assert s["p90_itl_ms"] == pytest.approx(510)
    assert s["p99_itl_ms"] == pytest.approx(591)
    assert s["mean_itl_ms"] == pytest.approx(300)
    # TPOT over a and b only (e has one token): [366.67, 100] ms
    assert s["median_tpot_ms"] == pytest.approx((1100 / 3 + 100) / 2)
    assert s["p99_tpot_ms"] == pytest.approx(100 + 0.99 * (1100 / 3 - 100))
    # E2EL: [1600, 300, 400] ms
    assert s["median_e2el_ms"] == pytest.approx(400)
    assert s["mean_e2el_ms"] == pytest.approx(2300 / 3)


def test_vllm_key_names_present() -> None:
    s = summarize(trace(), duration_s=4.0)
    for key in ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput"):
        assert key in s
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in s


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        ("ttft_ms=450", 2),  # a misses (500 ms)
        ("ttft_ms=450,tpot_ms=200", 2),  # e's TPOT counts as 0
        ("ttft_ms=450,tpot_ms=50", 1),  # b's TPOT is 100 ms
        ("e2el_ms=350", 1),  # only b
        ("ttft_ms=10000,tpot_ms=10000,e2el_ms=10000", 3),  # failures are never good
    ],
)
def test_goodput(slo: str, good: int) -> None:
    s = summarize(trace(), duration_s=4.0, slo=parse_slo(slo))
    assert s["good_completed"] == good
    assert s["request_goodput"] == pytest.approx(good / 4.0)


def test_no_goodput_keys_without_slo() -> None:
    assert "request_goodput" not in summarize(trace(), duration_s=4.0)


def test_all_failed_gives_none_latencies_not_zero() -> None:
    s = summarize([record("x", 0.0, [], RequestStatus.TIMEOUT, 9.0, output_len=3)], duration_s=9.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["timed_out"] == 1
    assert s["p99_ttft_ms"] is None and s["mean_itl_ms"] is None
    assert s["output_throughput"] == 0


def test_truncated_completions_are_counted() -> None:
    r = record("t", 0.0, [0.1, 0.2], RequestStatus.COMPLETED, 0.2, output_len=5)
    assert summarize([r], duration_s=1.0)["num_truncated"] == 1


def test_unfinished_record_is_a_bug() -> None:
    r = RequestRecord("u", 1, 1, 0.0)
    with pytest.raises(AssertionError, match="no final status"):
        summarize([r], duration_s=1.0)


def test_record_finishes_once() -> None:
    r = record("f", 0.0, [0.1], RequestStatus.COMPLETED, 0.1)
    with pytest.raises(AssertionError, match="finished twice"):
        r.finish(RequestStatus.TIMEOUT, 1.0)


def test_record_round_trip() -> None:
    r = trace()[3]
    assert RequestRecord.from_dict(r.to_dict()) == r


def test_percentile_key_and_stats() -> None:
    assert percentile_key(99) == "p99"
    assert percentile_key(99.9) == "p99.9"
    stats = latency_stats("x", [0.001, 0.002, 0.003, 0.004], [50, 99.9])
    assert stats["p50_x_ms"] == pytest.approx(2.5)
    assert stats["p99.9_x_ms"] == pytest.approx(1 + 3 * 0.999 * 1.0)
    assert stats["std_x_ms"] == pytest.approx(1.118034, rel=1e-5)


def test_parse_slo() -> None:
    assert parse_slo("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("ttft=500", "ttft_ms", "ttft_ms=abc", "ttft_ms=0", "itl_ms=5"):
        with pytest.raises(SLOError):
            parse_slo(bad)


def kv(t: float, used: int, stored: int, running: int, contiguous: int) -> KVSample:
    return KVSample(
        t=t,
        num_used_blocks=used,
        num_total_blocks=100,
        block_size=16,
        num_tokens_stored=stored,
        num_empty_slots=used * 16 - stored,
        num_running=running,
        num_waiting=0,
        num_contiguous_slots=contiguous,
        num_max_model_len_slots=running * 1024,
    )


def test_kv_waste() -> None:
    # step 1: 2 requests, 10 blocks = 160 slots, 150 stored; step 2: 1 request, 4 blocks, 64 stored.
    samples = [kv(0.1, 10, 150, 2, 400), kv(0.2, 4, 64, 1, 100)]
    s = summarize_kv(samples, num_preemptions=3)
    assert s["peak_kv_blocks_used"] == 10
    assert s["peak_kv_usage_pct"] == pytest.approx(10.0)
    assert s["kv_waste_pct"] == pytest.approx(100 * 10 / 224)
    assert s["max_kv_waste_pct_per_step"] == pytest.approx(100 * 10 / 160)
    assert s["contiguous_waste_pct"] == pytest.approx(100 * (500 - 214) / 500)
    assert s["max_model_len_waste_pct"] == pytest.approx(100 * (3072 - 214) / 3072)
    assert s["contiguous_to_paged_slots"] == pytest.approx(500 / 224)
    assert s["num_preemptions"] == 3
    assert summarize_kv([], 0) == {"num_kv_samples": 0, "num_preemptions": 0}
