"""The compute-limit arithmetic: linear-layer FLOPs per token, the idealised schedule of a request
set, row buckets, and the time at given rates; one real F.linear measurement."""

from __future__ import annotations

import pytest
import torch

from qworker.bench.compute_limit import (
    config_shapes,
    idealised_schedule,
    measure_compute_limit,
    model_shapes,
    needed_points,
    row_bucket,
    schedule_flops,
    schedule_seconds,
)
from qworker.bench.report import render_report_md, throughput_ratios
from qworker.model.registry import model_config_from_hf
from qworker.testing.tiny_model import TINY_LLAMA, tiny_llama_config

pytestmark = pytest.mark.timeout(60)

# SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9 heads and 3 KV heads of 64, vocabulary 49,152.
SMOLLM2 = dict(
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
)


def test_smollm2_linear_flops_per_token():
    shapes = model_shapes(**SMOLLM2)
    # qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576: 3,538,944 weights a layer.
    per_layer = 576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576
    assert per_layer == 3_538_944
    assert shapes.layer_flops_per_token == 2 * 30 * per_layer
    assert shapes.lm_head.flops_per_row == 2 * 576 * 49152
    # 2 x (106M layer weights + the 28M tied lm_head) per sampled token: SmolLM2 has 135M parameters.
    assert shapes.layer_flops_per_token + shapes.lm_head.flops_per_row == 2 * (30 * per_layer + 576 * 49152)


@pytest.mark.parametrize(
    ("rows", "bucket"),
    [
        (1, 1),
        (2, 2),
        (3, 4),
        (5, 4),
        (6, 8),
        (11, 8),
        (12, 16),
        (90, 64),
        (91, 128),
        (128, 128),
        (2048, 2048),
    ],
)
def test_row_bucket_is_the_nearest_power_of_two_on_a_log_scale(rows, bucket):
    assert row_bucket(rows) == bucket


def test_idealised_schedule_counts_tokens_and_rows():
    # Prompts 100 + 60 = 160 tokens at a budget of 64: steps of 64, 64 and 32 rows.
    # Outputs 3 and 1: step 0 samples both (the prefill), step 1 and 2 decode the first request only.
    schedule = idealised_schedule([100, 60], [3, 1], max_num_batched_tokens=64, max_num_seqs=256)
    assert schedule.layer_steps == {64: 2, 32: 1, 1: 2}
    assert schedule.lm_head_steps == {2: 1, 1: 2}
    # Through the decoder: both prompts plus 2 fed-back tokens; sampled: 4 outputs.
    assert schedule.num_forward_tokens == 160 + 2
    assert schedule.num_sampled_tokens == 4
    layer_rows = sum(r * c for r, c in schedule.layer_steps.items())
    head_rows = sum(r * c for r, c in schedule.lm_head_steps.items())
    assert layer_rows == schedule.num_forward_tokens
    assert head_rows == schedule.num_sampled_tokens


def test_schedule_splits_decode_batches_at_max_num_seqs():
    schedule = idealised_schedule([10] * 5, [2] * 5, max_num_batched_tokens=1000, max_num_seqs=2)
    # 5 running, at most 2 a step: 2 + 2 + 1, for the prefill's sample and the one decode step.
    assert schedule.lm_head_steps == {2: 4, 1: 2}
    assert schedule.layer_steps == {50: 1, 2: 2, 1: 1}


def test_flops_and_seconds_at_given_rates():
    shapes = model_shapes(**SMOLLM2)
    schedule = idealised_schedule([100, 60], [3, 1], max_num_batched_tokens=64, max_num_seqs=256)
    flops = schedule_flops(shapes, schedule)
    assert flops == 162 * shapes.layer_flops_per_token + 4 * shapes.lm_head.flops_per_row
    # Every point at 1 TFLOP/s: the time is the FLOPs over 1e12.
    rates = {(shape.name, rows): 1e12 for shape, rows in needed_points(shapes, schedule)}
    assert schedule_seconds(shapes, schedule, rates) == pytest.approx(flops / 1e12)
    # Twice as fast for the 64-row layer steps only: their share of the time halves.
    faster = dict(rates)
    for shape in shapes.layers:
        faster[(shape.name, 64)] = 2e12
    saved = 128 * shapes.layer_flops_per_token / 2e12
    assert schedule_seconds(shapes, schedule, faster) == pytest.approx(flops / 1e12 - saved)


def test_needed_points_cover_each_bucket_once():
    shapes = model_shapes(**SMOLLM2)
    schedule = idealised_schedule([100, 60], [3, 1], max_num_batched_tokens=64, max_num_seqs=256)
    points = [(shape.name, rows) for shape, rows in needed_points(shapes, schedule)]
    assert len(points) == len(set(points))
    assert set(points) == {
        *((name, rows) for name in ("qkv", "o", "gate_up", "down") for rows in (1, 32, 64)),
        ("lm_head", 1),
        ("lm_head", 2),
    }


def test_measured_limit_on_a_small_model_and_the_report_lines():
    shapes = config_shapes(model_config_from_hf(tiny_llama_config()))
    assert shapes.lm_head.out_features == TINY_LLAMA["vocab_size"]
    limit = measure_compute_limit(
        shapes, [20, 12], [4, 2], dtype=torch.float32, max_num_batched_tokens=16, max_num_seqs=8
    )
    assert limit.num_output_tokens == 6
    assert limit.flops == schedule_flops(shapes, idealised_schedule([20, 12], [4, 2], 16, 8))
    assert limit.seconds > 0 and all(point["tflops"] > 0 for point in limit.rates)
    assert limit.max_output_throughput == pytest.approx(6 / limit.seconds)

    def run(name: str, tput: float) -> dict:
        summary = {"output_throughput": tput, "failed": 0}
        return {
            "name": name,
            "system": name,
            "mode": "engine",
            "rate_label": "all at once",
            "summary": summary,
        }

    runs = [run("qworker", 300.0), run("vllm-cpu", 200.0), run("hf-static", 100.0)]
    ratios = {(r["name"], r["other"]): r["output_throughput_x"] for r in throughput_ratios(runs)}
    assert ratios == {
        ("qworker", "vllm-cpu"): 1.5,
        ("qworker", "hf-static"): 3.0,
        ("vllm-cpu", "hf-static"): 2.0,
    }
    from qworker.bench.report import _compute_limit_lines

    text = "\n".join(_compute_limit_lines({"rate_label": "all at once", **limit.to_dict()}, runs))
    assert "## Compute limit" in text
    share = 100 * 300.0 / limit.max_output_throughput
    assert f"| qworker | 300 | {share:.1f}% |" in text or f"| qworker | 300 | {share:,.0f}% |" in text
    assert callable(render_report_md)
