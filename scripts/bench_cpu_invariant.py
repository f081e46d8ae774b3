"""Micro-benchmark of the batch-invariant CPU kernels against the default ones, at SmolLM2-135M's
shapes (hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64, vocabulary 49,152).

    OMP_NUM_THREADS=1 python scripts/bench_cpu_invariant.py [--dtype bfloat16] [--rows 1,16,128,256,2048]

GEMM: oneDNN's packed linear (what the default path runs) against the invariant GEMM, on AMX tiles
where this CPU and build have them and on its AVX-512 path (``QWORKER_INVARIANT_GEMM_AMX=0`` at
pack time). Attention: a prefill of one prompt (the prefill kernel against the invariant kernel)
and a decode step of many sequences (the decode kernel against the invariant kernel). Prints the
median of several timed calls in milliseconds; on a shared machine the figures are indicative.
"""

# The timed lambdas run within the loop iteration that made them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def median_ms(fn: Callable[[], object], min_time_s: float = 0.3, max_calls: int = 50) -> float:
    fn()  # warm-up: packing caches, page faults
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_calls and (len(times) < 3 or time.perf_counter() - start < min_time_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_gemm(dtype: torch.dtype, rows: list[int]) -> None:
    from qworker_kernels import cpu_invariant_gemm

    gen = torch.Generator().manual_seed(0)
    print(f"GEMM {str(dtype)[6:]}, {torch.get_num_threads()} thread(s): ms (invariant / oneDNN)")
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        variants = {"onednn": None}
        if dtype == torch.bfloat16 and cpu_invariant_gemm.amx_enabled():
            variants["inv-amx"] = cpu_invariant_gemm.pack_weight(weight)
        os.environ["QWORKER_INVARIANT_GEMM_AMX"] = "0"
        try:
            variants["inv-avx512"] = cpu_invariant_gemm.pack_weight(weight)
        finally:
            del os.environ["QWORKER_INVARIANT_GEMM_AMX"]
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            cells = []
            base = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))
            cells.append(f"onednn {base:8.3f}")
            for label, packed in variants.items():
                if packed is None:
                    continue
                t = median_ms(lambda packed=packed: cpu_invariant_gemm.linear(x, packed))
                cells.append(f"{label} {t:8.3f} ({t / base:4.2f}x)")
            print(f"  {name:8} {n:5}x{k:<5} M={m:<5} " + "  ".join(cells))


def bench_attention(dtype: torch.dtype, prefill_len: int, decode_seqs: int, decode_ctx: int) -> None:
    from qworker_kernels import cpu_invariant_attention as inv
    from qworker_kernels import cpu_paged_attention as decode
    from qworker_kernels import cpu_prefill_attention as prefill

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    scale = dim**-0.5
    print(f"attention {str(dtype)[6:]}, {torch.get_num_threads()} thread(s): ms")
    # One prompt of prefill_len tokens, whole.
    blocks = prefill_len // block + 1
    k_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    q = torch.randn(prefill_len, heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    lens = torch.tensor([prefill_len], dtype=torch.int32)
    starts = torch.tensor([0, prefill_len], dtype=torch.int32)
    seq = torch.zeros(prefill_len, dtype=torch.int32)
    pos = torch.arange(prefill_len, dtype=torch.int32)
    base = median_ms(
        lambda: prefill.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, 0, 1, scale, out)
    )
    t = median_ms(lambda: inv.paged_attention(q, k_cache, v_cache, tables, seq, pos, scale, out=out))
    print(f"  prefill {prefill_len} tokens: prefill kernel {base:8.3f}  invariant {t:8.3f} ({t / base:.2f}x)")
    # One decode step of decode_seqs sequences at decode_ctx tokens each.
    per_seq = decode_ctx // block + 1
    blocks = decode_seqs * per_seq
    k_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(decode_seqs, per_seq)
    q = torch.randn(decode_seqs, heads, dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    lens = torch.full((decode_seqs,), decode_ctx, dtype=torch.int32)
    seq = torch.arange(decode_seqs, dtype=torch.int32)
    pos = torch.full((decode_seqs,), decode_ctx - 1, dtype=torch.int32)
    base = median_ms(lambda: decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=out))
    t = median_ms(lambda: inv.paged_attention(q, k_cache, v_cache, tables, seq, pos, scale, out=out))
    print(
        f"  decode {decode_seqs} seqs x {decode_ctx} tokens: decode kernel {base:8.3f}  "
        f"invariant {t:8.3f} ({t / base:4.2f}x)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", default="1,16,128,256,2048")
    parser.add_argument("--only", choices=("gemm", "attention"), default=None)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--decode-seqs", type=int, default=32)
    parser.add_argument("--decode-ctx", type=int, default=512)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.only in (None, "gemm"):
        bench_gemm(dtype, [int(r) for r in args.rows.split(",")])
    if args.only in (None, "attention"):
        bench_attention(dtype, args.prefill_len, args.decode_seqs, args.decode_ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
