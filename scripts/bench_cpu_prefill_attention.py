"""Benchmark the CPU paged prefill attention kernel's bf16 paths against each other: AMX tiles
(TDPBF16PS) and AVX512-BF16 dot products (VDPBF16PS), kernel calls only, in the same run.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, block size 16), 2048 query
tokens per call as a prefill step of that size hands the kernel: prompts of one length (32 to 512
tokens), a ragged mix of 32-512, and 512-token chunks over a 512-token cached prefix. Calls of the
two paths alternate, round by round, so that load from other work on the machine falls on both
alike. Figures are GFLOP/s of the causal products (4 * head_dim FLOPs per visible query-key pair
per head: the work of Q K^T and P V, masked pairs not counted), from the median call and from the
best call (in brackets); ratios are of medians.

    .venv/bin/python scripts/bench_cpu_prefill_attention.py [--threads 1 2] [--iters 20]

Without AMX (a CPU without amx_bf16, or the process refused the tile state) the AMX column
is missing and the script says so.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from qworker_kernels import cpu_prefill_attention as kernel
from qworker_kernels.testing import PagedBatch, make_paged_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
TOKENS = 2048


def cases() -> dict[str, list[tuple[int, int]]]:
    """Name -> (cached prefix, chunk) per sequence, TOKENS query tokens in all."""
    rng = random.Random(0)
    ragged: list[tuple[int, int]] = []
    while sum(n for _, n in ragged) < TOKENS:
        ragged.append((0, min(rng.randint(32, 512), TOKENS - sum(n for _, n in ragged))))
    out = {f"{TOKENS // n}x{n}": [(0, n)] * (TOKENS // n) for n in (32, 128, 256, 512)}
    out["ragged 32-512"] = ragged
    out["4x(512+512)"] = [(512, 512)] * 4
    return out


def causal_flops(seqs: list[tuple[int, int]]) -> float:
    """FLOPs of Q K^T and P V over the visible pairs: chunk query i of a (prefix, n) sequence sees
    prefix + i + 1 keys."""
    pairs = sum(prefix * n + n * (n + 1) // 2 for prefix, n in seqs)
    return 4.0 * HEAD_DIM * NUM_HEADS * pairs


def time_rounds(fns: dict[str, Callable[[], object]], iters: int) -> dict[str, tuple[float, float]]:
    """(median, best) seconds per call of each function, calls interleaved round by round."""
    for fn in fns.values():  # warm-up: build, page in, settle the thread pool
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def bench_case(batch: PagedBatch, num_seqs: int, iters: int, use_amx: bool) -> dict[str, tuple[float, float]]:
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    outs = {"amx": torch.empty_like(batch.q), "vdpbf16ps": torch.empty_like(batch.q)}

    def run(name: str) -> Callable[[], object]:
        allow = name == "amx"
        return lambda: kernel.paged_prefill_attention(
            *args, 0, num_seqs, batch.scale, outs[name], allow_amx=allow
        )

    names = ["amx", "vdpbf16ps"] if use_amx else ["vdpbf16ps"]
    fns = {name: run(name) for name in names}
    result = time_rounds(fns, iters)
    if use_amx:  # the two paths agree (each is checked against a reference by the tests)
        torch.testing.assert_close(outs["amx"].float(), outs["vdpbf16ps"].float(), atol=2e-2, rtol=2e-2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not kernel.is_available():
        raise SystemExit("the C kernel could not be built")
    use_amx = kernel.amx_available()
    print(
        f"AMX path: {'yes' if use_amx else 'no (not built for AMX, or the tile state was refused)'}; "
        f"torch {torch.__version__}; {HEAD_DIM=} heads {NUM_HEADS}/{NUM_KV_HEADS} block {BLOCK_SIZE}"
    )
    print("GFLOP/s: median call [best call]")
    print(f"{'threads':>7} {'case':>14} {'GFLOP':>6} {'amx':>15} {'vdpbf16ps':>15} {'amx/vdp':>7}")
    batches = {
        name: (
            make_paged_batch(
                seqs,
                block_size=BLOCK_SIZE,
                head_dim=HEAD_DIM,
                num_heads=NUM_HEADS,
                num_kv_heads=NUM_KV_HEADS,
                dtype=torch.bfloat16,
            ),
            seqs,
        )
        for name, seqs in cases().items()
    }
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, (batch, seqs) in batches.items():
                flops = causal_flops(seqs)
                row = bench_case(batch, len(seqs), args.iters, use_amx)
                cells = {
                    path: f"{flops / row[path][0] / 1e9:6.1f} [{flops / row[path][1] / 1e9:6.1f}]"
                    if path in row
                    else "-"
                    for path in ("amx", "vdpbf16ps")
                }
                ratio = f"{row['vdpbf16ps'][0] / row['amx'][0]:.2f}" if use_amx else "-"
                print(
                    f"{threads:>7} {name:>14} {flops / 1e9:6.2f} {cells['amx']:>15} {cells['vdpbf16ps']:>15}"
                    f" {ratio:>7}",
                    flush=True,
                )
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
