"""Batch invariance, the full matrix and the kernel probes.

    python scripts/invariance_matrix.py --probe    # where a row's bits change (docs/reproducibility.md)
    python scripts/invariance_matrix.py [--num-prompts 64] [--dtypes bfloat16,float32] [--traffic-runs 3]

The matrix runs tests/integration/test_batch_invariance.py's schedules (alone, together, random
groups with sampled traffic, budgets 8/64/2048, preemption, prefix-cache hits) on SmolLM2 with
`batch_invariant=True`, and once with the mode off for comparison; it prints, per dtype and mode,
how many prompts kept the same tokens and the same logprobs in every run. Exit 1 when the mode on
differs anywhere.
"""

# The probes' lambdas and helpers run within the loop iteration that made them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

ROW_COUNTS = (1, 2, 7, 8, 16, 17, 32, 64, 128, 256, 512, 2048)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))


def probe_linear() -> None:
    import torch.nn.functional as F
    from qworker_kernels import cpu_invariant_gemm

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for n, k in SHAPES:
            weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            invariant = cpu_invariant_gemm.pack_weight(weight)
            ops = {
                "onednn-packed": lambda x: torch.ops.mkldnn._linear_pointwise(
                    x, onednn, None, "none", [], ""
                ),
                "F.linear": lambda x: F.linear(x, weight),
                "invariant": lambda x: cpu_invariant_gemm.linear(x, invariant),
            }
            row = torch.randn(1, k, generator=gen).to(dtype)
            for name, op in ops.items():
                alone = op(row)
                marks = []
                for rows in ROW_COUNTS:
                    batch = torch.randn(rows, k, generator=gen).to(dtype)
                    batch[rows // 2] = row[0]
                    marks.append("=" if torch.equal(op(batch)[rows // 2], alone[0]) else "x")
                print(f"linear {str(dtype)[6:]:9} {n}x{k:<5} {name:14} {''.join(marks)}  (M = {ROW_COUNTS})")


def probe_attention() -> None:
    from qworker_kernels import cpu_invariant_attention as inv
    from qworker_kernels import cpu_paged_attention as decode
    from qworker_kernels import cpu_prefill_attention as prefill

    gen = torch.Generator().manual_seed(0)
    length, heads, kv_heads, dim, block = 200, 9, 3, 64, 16
    for dtype in (torch.bfloat16, torch.float32):
        blocks = length // block + 2
        k_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
        v_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
        tables = torch.arange(blocks, dtype=torch.int32)[None]
        q = torch.randn(length, heads, dim, generator=gen).to(dtype)
        whole, chunked, stepped = (torch.empty_like(q) for _ in range(3))

        def run_prefill(start: int, stop: int, out: torch.Tensor) -> None:
            lens = torch.tensor([stop], dtype=torch.int32)
            starts = torch.tensor([0, stop - start], dtype=torch.int32)
            prefill.paged_prefill_attention(
                q[start:stop], k_cache, v_cache, tables, lens, starts, 0, 1, 0.125, out
            )

        run_prefill(0, length, whole)
        for start in range(0, length, 8):
            run_prefill(start, min(start + 8, length), chunked[start : start + 8])
        for t in range(length):
            lens = torch.tensor([t + 1], dtype=torch.int32)
            decode.paged_decode_attention(
                q[t : t + 1], k_cache, v_cache, tables, lens, 0.125, out=stepped[t : t + 1]
            )
        seq = torch.zeros(length, dtype=torch.int32)
        pos = torch.arange(length, dtype=torch.int32)
        inv_whole = inv.paged_attention(q, k_cache, v_cache, tables, seq, pos, 0.125)
        inv_steps = torch.cat(
            [
                inv.paged_attention(
                    q[t : t + 1], k_cache, v_cache, tables, seq[t : t + 1], pos[t : t + 1], 0.125
                )
                for t in range(length)
            ]
        )

        def same(a: torch.Tensor, b: torch.Tensor) -> str:
            return f"{sum(torch.equal(a[t], b[t]) for t in range(length))}/{length}"

        print(
            f"attention {str(dtype)[6:]}: prefill whole vs chunks of 8 {same(whole, chunked)}; "
            f"prefill vs decode {same(whole, stepped)}; "
            f"invariant whole vs decode steps {same(inv_whole, inv_steps)}"
        )


def run_matrix(num_prompts: int, dtypes: list[str], traffic_runs: int) -> int:
    from qworker import LLM
    from tests.integration import test_batch_invariance as t

    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(2, 40), rng.randint(40, 300)]) for _ in range(num_prompts)]
    prompts = t.make_prompts(lengths, seed=1)
    failed = False
    for dtype in dtypes:
        for mode in (True, False):
            llm = LLM("smollm2", dtype=dtype, batch_invariant=mode, num_kv_blocks=t.NUM_KV_BLOCKS * 2)
            runs = t.run_matrix(llm, prompts, seed=2, num_traffic_runs=traffic_runs)
            same_tokens = sum(
                all(r[i][0] == runs["alone"][i][0] for r in runs.values()) for i in range(num_prompts)
            )
            same_all = sum(all(r[i] == runs["alone"][i] for r in runs.values()) for i in range(num_prompts))
            print(
                f"{dtype} batch_invariant={mode}: {len(runs)} runs; same tokens {same_tokens}/{num_prompts}, "
                f"same tokens and logprobs {same_all}/{num_prompts}"
            )
            if mode and same_all != num_prompts:
                failed = True
                print("  ", t.first_difference(runs, "alone"))
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", action="store_true", help="the kernel probes only")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--traffic-runs", type=int, default=3)
    args = parser.parse_args()
    if args.probe:
        probe_linear()
        probe_attention()
        return 0
    return run_matrix(args.num_prompts, args.dtypes.split(","), args.traffic_runs)


if __name__ == "__main__":
    sys.exit(main())
