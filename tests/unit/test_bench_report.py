"""Ratios, saturation rates and report rendering on synthetic runs with known answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from qworker.bench.metrics import summarize
from qworker.bench.records import RequestRecord, RequestStatus
from qworker.bench.report import comparisons, render_report_md, saturation, write_results_json

pytestmark = pytest.mark.timeout(60)


def fake_run(
    name: str, rate: float | None, ttft_s: float, tokens: int = 4, failed: int = 0, mode: str = "engine"
) -> dict:
    """Ten requests with the same TTFT and one token per 0.1 s; `failed` of them time out."""
    records = []
    for i in range(10):
        r = RequestRecord(f"r{i}", 10, tokens, float(i))
        if i < failed:
            r.finish(RequestStatus.TIMEOUT, float(i) + 100, "still running at the run's time limit")
        else:
            for k in range(tokens):
                r.add_chunk(i + ttft_s + 0.1 * k)
            r.finish(RequestStatus.COMPLETED, i + ttft_s + 0.1 * (tokens - 1))
            if mode == "queue":
                r.queue_wait_s = 0.05
        records.append(r)
    label = f"{rate:g}/s" if rate is not None else "all at once"
    return {
        "name": name if mode == "engine" else f"{name} [{mode}]",
        "system": name,
        "mode": mode,
        "rate": rate,
        "rate_label": label,
        "summary": summarize(records, duration_s=20.0),
        "kv": None,
        "meta": {"torch_threads": 2, "num_cpus_usable": 2},
        "records": [r.to_dict() for r in records],
        "kv_timeline": [],
    }


def sweep_runs() -> list[dict]:
    return [
        fake_run("qworker", 1, 0.5),
        fake_run("hf-static", 1, 3.0),
        fake_run("qworker", 2, 2.0),
        fake_run("hf-static", 2, 8.0),
        fake_run("qworker", 4, 4.5),
        fake_run("hf-static", 4, 12.0, failed=2),
        fake_run("qworker", 8, 12.0),
        fake_run("hf-static", 8, 20.0, failed=5),
    ]


def test_saturation_rates() -> None:
    by_name = {s["name"]: s for s in saturation(sweep_runs(), sustain_ttft_s=5.0)}
    assert by_name["qworker"]["max_sustained_rate"] == 4
    assert by_name["qworker"]["first_rate_p99_ttft_over_break"] == 8
    assert by_name["hf-static"]["max_sustained_rate"] == 1
    # 8 s p99 TTFT is not past 10 s; the failures at 4/s are.
    assert by_name["hf-static"]["first_rate_p99_ttft_over_break"] == 4


def test_sustained_rate_stops_at_the_first_miss() -> None:
    runs = [fake_run("x", 1, 1.0), fake_run("x", 2, 9.0), fake_run("x", 4, 1.0)]
    assert saturation(runs, 5.0)[0]["max_sustained_rate"] == 1


def test_comparisons_against_the_baseline() -> None:
    comps = comparisons(sweep_runs(), "hf-static")
    assert [c["rate_label"] for c in comps] == ["1/s", "2/s", "4/s", "8/s"]
    first = comps[0]
    assert first["output_throughput_x"] == pytest.approx(1.0)  # same tokens, same duration
    assert first["p99_ttft_speedup"] == pytest.approx(6.0)
    assert first["both_clean"] and not comps[2]["both_clean"]
    assert comparisons(sweep_runs(), None) == []


def payload(runs: list[dict]) -> dict:
    return {
        "meta": {
            "created_at": "now",
            "command": "qworker bench ...",
            "host": {"platform": "p", "cpu_count": 2, "torch_version": "t", "torch_threads": 2},
            "percentiles": [90.0, 99.0],
            "baseline": "hf-static",
            "slo": {},
            "sustain_ttft_s": 5.0,
        },
        "workload": {"name": "w", "about": ""},
        "request_sets": [
            {
                "rate_label": "1/s",
                "num_requests": 10,
                "mean_prompt_len": 10.0,
                "max_prompt_len": 10,
                "mean_output_len": 4.0,
                "max_output_len": 4,
                "last_arrival_s": 9.0,
                "sha256": "ab" * 32,
                "sha256_without_arrivals": "cd" * 32,
            }
        ],
        "runs": runs,
        "comparisons": comparisons(runs, "hf-static"),
        "saturation": saturation(runs, 5.0),
        "notes": ["a note"],
    }


def test_report_renders_every_section(tmp_path: Path) -> None:
    runs = [*sweep_runs(), fake_run("qworker", 1, 0.7, mode="queue"), fake_run("dead", 1, 1.0, failed=10)]
    data = payload(runs)
    text = render_report_md(data, ["latency_cdf.png"])
    for needle in (
        "## Results",
        "## Against the baseline (hf-static)",
        "## Saturation",
        "qworker sustains 4.00× the rate hf-static sustains.",
        "## Queue",
        "What the queue costs",
        "## Failures and timeouts",
        "dead @ 1/s: 10 × timeout: still running at the run's time limit",
        "- a note",
        "![latency_cdf](latency_cdf.png)",
    ):
        assert needle in text, needle
    write_results_json(tmp_path / "results.json", data)
    assert (tmp_path / "results.json").stat().st_size > 0


def test_plots_render_including_a_run_with_nothing_completed(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from qworker.bench.plots import make_plots

    runs = [*sweep_runs(), fake_run("dead", 1, 1.0, failed=10)]
    files = make_plots(payload(runs), tmp_path)
    assert "rate_sweep.png" in files and "latency_cdf_1_s.png" in files
    for name in files:
        assert (tmp_path / name).stat().st_size > 10_000
