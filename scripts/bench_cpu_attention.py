"""Benchmark CPU paged decode attention against gather + SDPA and the memory-bandwidth floor.

The gather + SDPA baseline is the kernel module's own plain-torch fallback: it gathers every
sequence's K and V through the block table into contiguous tensors and runs SDPA on them, in
groups of at most 64 MiB of gathered K/V, which at these shapes is the whole batch in one group.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, block size 16). Each case
builds several layers' caches (more bytes than the L3 holds) and visits them in turn, as a decode
step does, so K and V come from memory rather than cache. Block tables are shuffled block ids, as
in a fragmented pool. Figures are ms per call (one layer), median and best; ratios compare within
this run, since these machines are shared and noisy (the best call shows the machine when quiet).

    .venv/bin/python scripts/bench_cpu_attention.py [--dtype bf16 fp32] [--iters 30]

With --window W the cases are --window-cases (default 64 sequences x 4096 tokens) and the kernel
runs twice per layer, over the whole context and over a sliding window of W keys (a windowed decode
reads only the blocks its window touches), beside the torch fallback with the same window (which
gathers the whole context and masks it).

    .venv/bin/python scripts/bench_cpu_attention.py --dtype bf16 --window 512

With --compare-source FILE another version of kernels/cpu_paged_attention.c (the headers it
includes are taken from kernels/) is built and timed in the same rounds, as column "other", so that
a change can be judged on a loaded machine by the ratio k/other:

    git show HEAD~1:kernels/cpu_paged_attention.c > /tmp/old.c
    .venv/bin/python scripts/bench_cpu_attention.py --dtype bf16 --compare-source /tmp/old.c
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CASES = ((128, 400), (32, 1000), (1, 2000))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _time_rounds(fns: dict[str, Callable[[int], object]], num_layers: int, iters: dict[str, int]) -> dict:
    """Interleaved rounds (each function once per layer per round, the order reversed every other
    round), so that noise from other work on the machine lands on every function alike.

    Returns per function (median, best, uncontended median) in ms per call. "Uncontended" calls are
    those whose process CPU time reached 90% of threads x wall time: every thread ran throughout,
    none was descheduled for another process (on these shared 2-core machines a descheduled thread
    stalls a parallel call by a 4 ms scheduler tick). None when no call qualified.
    """
    threads = torch.get_num_threads()
    for fn in fns.values():  # warm-up: page in, build, settle the thread pool
        for layer in range(num_layers):
            fn(layer)
    wall: dict[str, list[float]] = {name: [] for name in fns}
    quiet: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(max(iters.values())):
        # Odd rounds run the functions in reverse order: a function run right after another one
        # meets caches and prefetchers as that one left them (two builds of the same source,
        # timed in a fixed order, differed by 7% here).
        order = list(fns.items()) if i % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            if i >= iters[name]:
                continue
            for layer in range(num_layers):
                cpu0, start = time.process_time(), time.perf_counter()
                fn(layer)
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
                wall[name].append(elapsed * 1e3)
                if cpu >= 0.9 * threads * elapsed:
                    quiet[name].append(elapsed * 1e3)
    return {
        name: (statistics.median(t), min(t), statistics.median(quiet[name]) if quiet[name] else None)
        for name, t in wall.items()
    }


def _make_caches(
    dtype: torch.dtype, num_seqs: int, context: int, args: argparse.Namespace
) -> tuple[int, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(num_layers, k_caches, v_caches, qs, block_tables, seq_lens) for one case."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    esize = torch.finfo(dtype).bits // 8
    layer_bytes = 2 * num_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * esize
    # Enough layers that the working set is several times the L3 (32 MiB here).
    num_layers = max(args.min_layers, math.ceil(args.working_set_mb * 2**20 / layer_bytes))
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    v_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    qs = [torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(num_layers)]
    block_tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    return num_layers, k_caches, v_caches, qs, block_tables, seq_lens


def bench_window(
    mod: ModuleType, dtype: torch.dtype, num_seqs: int, context: int, window: int, args: argparse.Namespace
) -> dict:
    num_layers, k_caches, v_caches, qs, block_tables, seq_lens = _make_caches(dtype, num_seqs, context, args)
    out = torch.empty(num_seqs, NUM_HEADS, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5

    def full(i: int) -> object:
        return mod.paged_decode_attention(qs[i], k_caches[i], v_caches[i], block_tables, seq_lens, scale, out)

    def windowed(i: int) -> object:
        return mod.paged_decode_attention(
            qs[i], k_caches[i], v_caches[i], block_tables, seq_lens, scale, out, sliding_window=window
        )

    def torch_windowed(i: int) -> object:
        return mod.paged_decode_attention_torch(
            qs[i], k_caches[i], v_caches[i], block_tables, seq_lens, scale, out, sliding_window=window
        )

    expected = torch_windowed(0).clone()
    torch.testing.assert_close(windowed(0).float(), expected.float(), atol=2e-2, rtol=2e-2)
    fns = {"full": full, "windowed": windowed, "torch_windowed": torch_windowed}
    iters = {"full": args.iters, "windowed": args.iters, "torch_windowed": max(3, args.iters // 8)}
    return _time_rounds(fns, num_layers, iters)


def bench_case(
    mod: ModuleType,
    dtype: torch.dtype,
    num_seqs: int,
    context: int,
    args: argparse.Namespace,
    other: object | None = None,
) -> dict:
    num_layers, k_caches, v_caches, qs, block_tables, seq_lens = _make_caches(dtype, num_seqs, context, args)
    esize = torch.finfo(dtype).bits // 8
    out = torch.empty(num_seqs, NUM_HEADS, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5
    read_bytes = 2 * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * esize

    def kernel(i: int) -> object:
        return mod.paged_decode_attention(qs[i], k_caches[i], v_caches[i], block_tables, seq_lens, scale, out)

    def baseline(i: int) -> object:
        return mod.paged_decode_attention_torch(
            qs[i], k_caches[i], v_caches[i], block_tables, seq_lens, scale, out
        )

    # Floor: a copy of as many bytes as the kernel reads (K and V of one layer), source and destination
    # cold. Bandwidth counts read and write (a copy's usual figure); the floor reads at it.
    src = [
        torch.cat([c.view(-1), d.view(-1)])[: read_bytes // esize]
        for c, d in zip(k_caches, v_caches, strict=True)
    ]
    dst = [torch.empty_like(x) for x in src]

    def copy(i: int) -> object:
        return dst[i].copy_(src[i])

    expected = baseline(0).clone()
    torch.testing.assert_close(kernel(0).float(), expected.float(), atol=2e-2, rtol=2e-2)
    fns = {"kernel": kernel, "copy": copy, "gather_sdpa": baseline}
    iters = {"kernel": args.iters, "copy": args.iters, "gather_sdpa": max(3, args.iters // 8)}
    if other is not None:

        def other_kernel(i: int) -> object:
            return mod.paged_decode_attention(
                qs[i], k_caches[i], v_caches[i], block_tables, seq_lens, scale, out, library=other
            )

        torch.testing.assert_close(other_kernel(0).float(), expected.float(), atol=2e-2, rtol=2e-2)
        # Right after the kernel in every round, so that both meet the machine alike.
        fns = {"kernel": kernel, "other": other_kernel, "copy": copy, "gather_sdpa": baseline}
        iters["other"] = args.iters
    row = _time_rounds(fns, num_layers, iters)
    copy_median, copy_min, copy_quiet = row.pop("copy")
    row["copy_gbs"] = 2 * read_bytes / copy_min / 1e6  # read + write, best call
    row["floor"] = tuple(None if t is None else t / 2 for t in (copy_median, copy_min, copy_quiet))
    row["read_mb"] = read_bytes / 1e6
    return row


def _cell(row: dict, key: str) -> str:
    if key not in row:
        return "-"
    median, best, quiet = row[key]
    return f"{median:7.3f} [{best:6.3f}] ({'-' if quiet is None else f'{quiet:.3f}'})"


def _ratio(row: dict, num: str, den: str) -> str:
    # Uncontended medians where both have them, else plain medians.
    use = 2 if row[num][2] is not None and row[den][2] is not None else 0
    return f"{row[num][use] / row[den][use]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--working-set-mb", type=float, default=128.0)
    parser.add_argument("--min-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    parser.add_argument("--window", type=int, default=None, help="compare a sliding window of this many keys")
    parser.add_argument("--window-cases", nargs="+", default=["64x4096"], help="SEQSxCONTEXT, with --window")
    parser.add_argument(
        "--compare-source", type=Path, default=None, help="another cpu_paged_attention.c to time beside"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import qworker_kernels.cpu_paged_attention as mod

    start = time.perf_counter()
    available = mod.is_available()
    print(
        f"C kernel available: {available} (load/build {time.perf_counter() - start:.2f} s), "
        f"bf16 code {mod.bf16_variant()}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    other = None
    if args.compare_source is not None:
        # The other source is built in a folder of its own, beside copies of the kernels' headers.
        folder = Path(tempfile.mkdtemp(prefix="qw-compare-"))
        for header in Path(mod.__file__).parent.glob("*.h"):
            shutil.copy(header, folder)
        shutil.copy(args.compare_source, folder / "cpu_paged_attention.c")
        other = mod.kernel_build(source=folder / "cpu_paged_attention.c")
        other.require()
        print(f"other: {args.compare_source} (column 'other', ratio k/other)")
    print(
        "ms per call (one layer): median [best call] (median of uncontended calls); "
        "ratios of uncontended medians where there are some"
    )
    if args.window is not None:
        window_name = f"window {args.window}"
        print(
            f"{'dtype':5} {'batch x ctx':>11} {'full':>26} {window_name:>26} {'torch window':>28}"
            f" {'full/window':>11}"
        )
        for name in args.dtype:
            for case in args.window_cases:
                num_seqs, context = (int(x) for x in case.split("x"))
                r = bench_window(mod, DTYPES[name], num_seqs, context, args.window, args)
                print(
                    f"{name:5} {case:>11} {_cell(r, 'full'):>26} {_cell(r, 'windowed'):>26}"
                    f" {_cell(r, 'torch_windowed'):>28} {_ratio(r, 'full', 'windowed'):>11}",
                    flush=True,
                )
        return
    extra = f" {'other':>26} {'o/floor':>7} {'k/other':>7}" if other is not None else ""
    print(
        f"{'dtype':5} {'batch x ctx':>11} {'MB read':>7} {'kernel':>26} {'floor':>26} {'copy GB/s':>9}"
        f" {'gather+sdpa':>28} {'k/floor':>7} {'sdpa/k':>6}{extra}"
    )
    for name in args.dtype:
        for num_seqs, context in CASES:
            r = bench_case(mod, DTYPES[name], num_seqs, context, args, other)
            line = (
                f"{name:5} {f'{num_seqs}x{context}':>11} {r['read_mb']:7.1f} {_cell(r, 'kernel'):>26}"
                f" {_cell(r, 'floor'):>26} {r['copy_gbs']:9.1f} {_cell(r, 'gather_sdpa'):>28}"
                f" {_ratio(r, 'kernel', 'floor'):>7} {_ratio(r, 'gather_sdpa', 'kernel'):>6}"
            )
            if other is not None:
                line += f" {_cell(r, 'other'):>26} {_ratio(r, 'other', 'floor'):>7}"
                line += f" {_ratio(r, 'kernel', 'other'):>7}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
