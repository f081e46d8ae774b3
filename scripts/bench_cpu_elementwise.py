"""Per-op timings of a CPU step's elementwise and sampling work at SmolLM2-135M shapes: the C
kernels of cpu_fused_ops against their torch references (add + RMSNorm, RMSNorm, rotary,
SiLU-and-mul at 2048 and 128 rows), the greedy sampler and the lm_head at 128 rows.

Each op is timed as the median of `--repeats` calls after a warm-up, on torch's thread count;
on a shared machine the ratios between rows of one run mean more than the absolute figures.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_cpu_elementwise.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from qworker_kernels import cpu_fused_ops
from qworker_kernels.rmsnorm_reference import fused_add_rms_norm_reference, rms_norm_reference

from qworker.engine.sampler import Sampler, SamplingRow
from qworker.engine.sampling_params import SamplingParams
from qworker.model.linear import PackedWeight, is_packing_available
from qworker.model.ops import apply_rotary_torch, silu_and_mul_torch

# SmolLM2-135M
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def elementwise(rows: int, dtype: torch.dtype, repeats: int) -> list[tuple[str, float, float]]:
    """(op, C ms, torch ms) at `rows` tokens."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
    gate_up = (torch.randn(rows, 2 * INTER, generator=gen) * 3).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(4096).float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    return [
        (
            "add + rms_norm",
            median_ms(lambda: cpu_fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5), repeats),
            median_ms(lambda: fused_add_rms_norm_reference(x, residual, weight, 1e-5), repeats),
        ),
        (
            "rms_norm",
            median_ms(lambda: cpu_fused_ops.rms_norm(x, weight, 1e-5), repeats),
            median_ms(lambda: rms_norm_reference(x, weight, 1e-5), repeats),
        ),
        (
            "rotary",
            median_ms(lambda: cpu_fused_ops.rotary(q, k, positions, cos, sin), repeats),
            median_ms(lambda: apply_rotary_torch(q, k, positions, cos, sin), repeats),
        ),
        (
            "silu_and_mul",
            median_ms(lambda: cpu_fused_ops.silu_and_mul(gate_up), repeats),
            median_ms(lambda: silu_and_mul_torch(gate_up), repeats),
        ),
    ]


def head_and_sampler(rows: int, dtype: torch.dtype, repeats: int) -> list[tuple[str, float]]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(dtype)
    packed = PackedWeight(is_packing_available())
    logits_model = packed.linear(hidden, weight)  # [rows, vocab] in the model dtype
    logits = logits_model.float()
    sampler = Sampler(eos_token_ids=(0,))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    greedy = [SamplingRow(params, 1, None) for _ in range(rows)]
    return [
        (f"lm_head matmul ({dtype})", median_ms(lambda: packed.linear(hidden, weight), repeats)),
        ("logits .float() (compute_logits before)", median_ms(lambda: logits_model.float(), repeats)),
        ("sampler, greedy rows, fp32 logits", median_ms(lambda: sampler.sample(logits, greedy), repeats)),
        (
            f"sampler, greedy rows, {dtype} logits",
            median_ms(lambda: sampler.sample(logits_model, greedy), repeats),
        ),
        ("torch argmax, fp32 (the sampler before)", median_ms(lambda: logits.argmax(dim=-1), repeats)),
        (f"torch argmax, {dtype}", median_ms(lambda: logits_model.argmax(dim=-1), repeats)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="*", default=[2048, 128])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{dtype}, {torch.get_num_threads()} threads, medians of {args.repeats} calls")
    for rows in args.rows:
        print(f"\n{rows} rows            C ms   torch ms   torch/C")
        for name, c_ms, torch_ms in elementwise(rows, dtype, args.repeats):
            print(f"  {name:<16} {c_ms:8.3f} {torch_ms:9.3f} {torch_ms / c_ms:8.2f}x")
    print("\n128 sampled rows, vocab 49152          ms")
    for name, ms in head_and_sampler(128, dtype, args.repeats):
        print(f"  {name:<42} {ms:8.3f}")


if __name__ == "__main__":
    main()
