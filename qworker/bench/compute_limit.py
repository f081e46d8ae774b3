"""The compute limit of a workload: its matmul FLOPs over the matmul rate this machine reaches at the
shapes the workload runs, measured in the same bench run.

FLOPs count the linear layers only (q/k/v, o, gate/up and down projections, 2 x in x out per token
and layer) for every token that goes through the decoder, plus the lm_head for the sampled
positions only (one per output token). Attention, norms, rotary, activation and sampling are left
out: they are what an engine adds on top of the limit.

Row counts follow an idealised schedule of the whole request set run together: prompts in steps of
the token budget (`max_num_batched_tokens` rows), then decode steps whose batch is every request
still generating (128, then fewer as outputs end). Each step's matmuls are timed at the nearest
power-of-two row count with `F.linear` in the run's dtype and thread count, so the limit is the
time these matmuls alone take at this machine's rates: no engine on these requests finishes
faster. For requests that arrive over time the real batches are smaller, and the limit is an
optimistic bound.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qworker.model.config import ModelConfig

# Timing of one (shape, rows) point: the best of REPEATS, each at least MIN_REPEAT_S long.
REPEATS = 5
MIN_REPEAT_S = 0.02


@dataclass(frozen=True)
class LinearShape:
    """One linear layer: `count` of them per token (one per decoder layer; 1 for the lm_head)."""

    name: str
    in_features: int
    out_features: int
    count: int

    @property
    def flops_per_row(self) -> int:
        return 2 * self.in_features * self.out_features * self.count


@dataclass(frozen=True)
class ModelShapes:
    layers: tuple[LinearShape, ...]
    lm_head: LinearShape

    @property
    def layer_flops_per_token(self) -> int:
        return sum(s.flops_per_row for s in self.layers)


def model_shapes(
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
) -> ModelShapes:
    """A Llama-family decoder's linear layers, as qworker runs them (q/k/v and gate/up fused)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return ModelShapes(
        layers=(
            LinearShape("qkv", hidden_size, q_size + 2 * kv_size, num_layers),
            LinearShape("o", q_size, hidden_size, num_layers),
            LinearShape("gate_up", hidden_size, 2 * intermediate_size, num_layers),
            LinearShape("down", intermediate_size, hidden_size, num_layers),
        ),
        lm_head=LinearShape("lm_head", hidden_size, vocab_size, 1),
    )


def config_shapes(config: ModelConfig) -> ModelShapes:
    """model_shapes of a model qworker loaded (its ModelConfig)."""
    return model_shapes(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
    )


def row_bucket(rows: int) -> int:
    """The power of two nearest `rows` (on a log scale; ties up), at least 1."""
    assert rows >= 1, f"rows must be >= 1, got {rows}"
    low = 1 << (rows.bit_length() - 1)
    return low if rows * rows < 2 * low * low else 2 * low


@dataclass(frozen=True)
class Schedule:
    """Rows per matmul call, as {row count: number of calls}, for the decoder layers and the lm_head."""

    layer_steps: Mapping[int, int]
    lm_head_steps: Mapping[int, int]
    num_forward_tokens: int
    num_sampled_tokens: int


def idealised_schedule(
    prompt_lens: Sequence[int], output_lens: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int
) -> Schedule:
    """Every request together: prompts packed into budget-sized steps, then decode steps.

    A request computes its prompt and then output_len - 1 more tokens (its last token is sampled and
    never fed back); it samples output_len tokens, the first in its prefill step.
    """
    assert len(prompt_lens) == len(output_lens), "one prompt length per output length"
    layer_steps: Counter[int] = Counter()
    lm_head_steps: Counter[int] = Counter()
    num_prompt_tokens = sum(prompt_lens)
    full, rest = divmod(num_prompt_tokens, max_num_batched_tokens)
    if full:
        layer_steps[max_num_batched_tokens] += full
    if rest:
        layer_steps[rest] += 1
    # Decode step s (0: the prefill's sample) runs every request with more than s outputs, at most
    # max_num_seqs of them at a time.
    max_output = max(output_lens, default=0)
    running = [sum(1 for n in output_lens if n > s) for s in range(max_output)]
    for s, num_running in enumerate(running):
        full, rest = divmod(num_running, max_num_seqs)
        for rows, calls in ((max_num_seqs, full), (rest, 1 if rest else 0)):
            if calls:
                lm_head_steps[rows] += calls
                if s > 0:
                    layer_steps[rows] += calls
    return Schedule(
        layer_steps=dict(layer_steps),
        lm_head_steps=dict(lm_head_steps),
        num_forward_tokens=num_prompt_tokens + sum(n - 1 for n in output_lens if n > 0),
        num_sampled_tokens=sum(output_lens),
    )


def schedule_flops(shapes: ModelShapes, schedule: Schedule) -> float:
    layer_rows = sum(rows * calls for rows, calls in schedule.layer_steps.items())
    head_rows = sum(rows * calls for rows, calls in schedule.lm_head_steps.items())
    return float(layer_rows * shapes.layer_flops_per_token + head_rows * shapes.lm_head.flops_per_row)


def schedule_seconds(
    shapes: ModelShapes, schedule: Schedule, rates: Mapping[tuple[str, int], float]
) -> float:
    """Time of the schedule's matmuls at `rates` (FLOP/s by (shape name, bucketed row count))."""
    seconds = 0.0
    for steps, group in ((schedule.layer_steps, shapes.layers), (schedule.lm_head_steps, (shapes.lm_head,))):
        for rows, calls in steps.items():
            bucket = row_bucket(rows)
            for shape in group:
                seconds += calls * rows * shape.flops_per_row / rates[(shape.name, bucket)]
    return seconds


def needed_points(shapes: ModelShapes, schedule: Schedule) -> list[tuple[LinearShape, int]]:
    points: list[tuple[LinearShape, int]] = []
    for steps, group in ((schedule.layer_steps, shapes.layers), (schedule.lm_head_steps, (shapes.lm_head,))):
        for bucket in sorted({row_bucket(rows) for rows in steps}):
            points.extend((shape, bucket) for shape in group)
    return points


def measure_linear_rate(shape: LinearShape, rows: int, dtype: Any) -> float:
    """FLOP/s of one `F.linear` of `rows` x in_features by the shape's weight, the best of REPEATS."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(rows, shape.in_features, dtype=dtype)
    weight = torch.randn(shape.out_features, shape.in_features, dtype=dtype)
    flops = 2.0 * rows * shape.in_features * shape.out_features
    with torch.inference_mode():
        for _ in range(2):
            F.linear(x, weight)
        start = time.perf_counter()
        F.linear(x, weight)
        once = max(time.perf_counter() - start, 1e-6)
        iters = max(1, int(MIN_REPEAT_S / once))
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            for _ in range(iters):
                F.linear(x, weight)
            best = min(best, (time.perf_counter() - start) / iters)
    return flops / best


@dataclass
class ComputeLimit:
    flops: float
    seconds: float
    num_output_tokens: int
    dtype: str
    torch_threads: int
    # (shape, rows, in, out, TFLOP/s) of every point measured.
    rates: list[dict[str, Any]]
    schedule: dict[str, Any]

    @property
    def max_output_throughput(self) -> float:
        return self.num_output_tokens / self.seconds

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["max_output_throughput"] = self.max_output_throughput
        return data


def measure_compute_limit(
    shapes: ModelShapes,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    *,
    dtype: Any,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> ComputeLimit:
    """Measure the rates this schedule needs, now, and return the workload's compute limit."""
    import torch

    schedule = idealised_schedule(prompt_lens, output_lens, max_num_batched_tokens, max_num_seqs)
    rates: dict[tuple[str, int], float] = {}
    table = []
    for shape, rows in needed_points(shapes, schedule):
        rate = measure_linear_rate(shape, rows, dtype)
        rates[(shape.name, rows)] = rate
        table.append(
            {
                "shape": shape.name,
                "rows": rows,
                "in_features": shape.in_features,
                "out_features": shape.out_features,
                "tflops": rate / 1e12,
            }
        )
    return ComputeLimit(
        flops=schedule_flops(shapes, schedule),
        seconds=schedule_seconds(shapes, schedule, rates),
        num_output_tokens=schedule.num_sampled_tokens,
        dtype=str(dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(),
        rates=table,
        schedule={
            "num_forward_tokens": schedule.num_forward_tokens,
            "num_sampled_tokens": schedule.num_sampled_tokens,
            "layer_rows": {str(k): v for k, v in sorted(schedule.layer_steps.items())},
            "lm_head_rows": {str(k): v for k, v in sorted(schedule.lm_head_steps.items())},
        },
    )
