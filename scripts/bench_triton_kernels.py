"""Microbenchmarks for the Triton kernels in kernels/.

On CUDA: split-K decode attention over a paged bf16 cache (num_heads 32, num_kv_heads 8, head_dim
128, block_size 16) at batch 1/16/64/256 x context 512/2048/8192, reported as achieved bandwidth
and as a fraction of a device-to-device copy measured in the same run (the machines are shared,
so ratios travel better than absolute numbers); then the elementwise kernels and one chunked
prefill. Timings use triton.testing.do_bench (median, L2 flushed between runs).

    python scripts/bench_triton_kernels.py [--json out.json] [--sweep-splits]
    python scripts/bench_triton_kernels.py --interpret   # tiny CPU smoke run, numbers meaningless
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


def _load_kernel_module(name: str) -> ModuleType:
    # Imported only here, after main() has set TRITON_INTERPRET for --interpret: Triton reads it
    # when a kernel is decorated.
    return importlib.import_module(f"qworker_kernels.{name}")


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="write all results to this JSON file")
    p.add_argument("--interpret", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 on the CPU")
    p.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (default 1 16 64 256)")
    p.add_argument("--contexts", type=int, nargs="+", help="decode context lengths (default 512 2048 8192)")
    p.add_argument(
        "--sweep-splits", action="store_true", help="also time fixed num_splits for each decode shape"
    )
    p.add_argument(
        "--no-check", action="store_true", help="skip the correctness check against the references"
    )
    return p.parse_args()


class Bench:
    """Shapes, device and timer for one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import triton.testing

        self.torch = torch
        self.do_bench = triton.testing.do_bench
        self.interpret = args.interpret
        self.device = torch.device("cpu" if args.interpret else "cuda")
        self.dtype = torch.float32 if args.interpret else torch.bfloat16
        self.check = not args.no_check
        if args.interpret:  # tiny: every program runs as numpy code
            self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = 4, 2, 64, 16
            self.batches, self.contexts = args.batches or [1, 2], args.contexts or [16, 40]
        else:
            self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = 32, 8, 128, 16
            self.batches, self.contexts = args.batches or [1, 16, 64, 256], args.contexts or [512, 2048, 8192]
        self.pa = _load_kernel_module("triton_paged_attention")

    def time_ms(self, fn: Callable[[], object]) -> float:
        if self.interpret:
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return float(self.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def copy_bandwidth_gbps(self) -> float:
        """Device-to-device copy: read + write bytes over time."""
        torch = self.torch
        nbytes = (64 if self.interpret else 1024) * 2**20
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_(0, 255)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        return 2 * nbytes / (ms * 1e-3) / 1e9

    # ------------------------------------------------------------------------------------------

    def decode(self, copy_gbps: float, sweep_splits: bool) -> list[dict[str, Any]]:
        torch, pa = self.torch, self.pa
        bs, kvh, hd = self.block_size, self.num_kv_heads, self.head_dim
        max_blocks_needed = max(b * -(-c // bs) for b in self.batches for c in self.contexts)
        # One cache for all shapes (8 GiB at 256 x 8192); each shape takes random blocks from it.
        cache_shape = (max_blocks_needed, bs, kvh, hd)
        k_cache = torch.empty(cache_shape, dtype=self.dtype, device=self.device).normal_()
        v_cache = torch.empty(cache_shape, dtype=self.dtype, device=self.device).normal_()
        gen = torch.Generator(device="cpu").manual_seed(0)
        rows = []
        for batch in self.batches:
            for context in self.contexts:
                blocks_per_seq = -(-context // bs)
                perm = torch.randperm(max_blocks_needed, generator=gen)[: batch * blocks_per_seq]
                block_tables = perm.view(batch, blocks_per_seq).to(torch.int32).to(self.device)
                seq_lens = torch.full((batch,), context, dtype=torch.int32, device=self.device)
                q = torch.randn((batch, self.num_heads, hd), device=self.device).to(self.dtype)
                out = torch.empty_like(q)
                scale = hd**-0.5
                auto_splits = pa.choose_decode_num_splits(batch, kvh, context, self.device)

                # run(num_splits=...) launches the decode kernels on this shape.
                run = functools.partial(
                    pa.paged_decode_attention,
                    *(q, k_cache, v_cache, block_tables, seq_lens, scale, out),
                    max_seq_len=context,
                )

                max_err = None
                if self.check and batch * context <= 16 * 2048:
                    expected = pa.paged_decode_attention_reference(
                        q, k_cache, v_cache, block_tables, seq_lens, scale
                    )
                    max_err = (run(num_splits=None).float() - expected.float()).abs().max().item()
                # K and V of every context token, plus q, out and the block table.
                nbytes = (
                    2 * batch * context * kvh * hd * k_cache.element_size()
                    + 2 * q.numel() * q.element_size()
                    + block_tables.numel() * 4
                )
                ms = self.time_ms(lambda run=run: run(num_splits=None))
                # The candidate split policy (QWORKER_DECODE_SPLITS=wave) on the same shape.
                num_sms = 4 if self.interpret else torch.cuda.get_device_properties(0).multi_processor_count
                wave_splits = pa.decode_num_splits(batch, kvh, context, num_sms, "wave")
                wave_ms = self.time_ms(lambda run=run, n=wave_splits: run(num_splits=n))
                row: dict[str, Any] = {
                    "batch": batch,
                    "context": context,
                    "num_splits": auto_splits,
                    "ms": ms,
                    "gbps": nbytes / (ms * 1e-3) / 1e9,
                    "fraction_of_copy": nbytes / (ms * 1e-3) / 1e9 / copy_gbps,
                    "max_abs_err": max_err,
                    "wave_num_splits": wave_splits,
                    "wave_ms": wave_ms,
                    "wave_speedup": ms / wave_ms,
                }
                if sweep_splits:
                    sweep = {}
                    for n in (1, 2, 4, 8, 16, 32):
                        if n <= max(1, context // 64):
                            sweep[n] = self.time_ms(lambda run=run, n=n: run(num_splits=n))
                    best = min(sweep, key=sweep.__getitem__)
                    row["sweep_ms"] = sweep
                    row["best_num_splits"] = best
                rows.append(row)
        return rows

    def prefill(self) -> list[dict[str, Any]]:
        """Chunked prefill through the varlen kernel: chunks after a cached prefix, in TFLOP/s."""
        torch, pa = self.torch, self.pa
        bs, kvh, hd, nh = self.block_size, self.num_kv_heads, self.head_dim, self.num_heads
        num_seqs, prefix, chunk = (2, 16, 24) if self.interpret else (4, 1024, 1024)
        seq_len = prefix + chunk
        blocks_per_seq = -(-seq_len // bs)
        cache_shape = (num_seqs * blocks_per_seq, bs, kvh, hd)
        k_cache = torch.empty(cache_shape, dtype=self.dtype, device=self.device).normal_()
        v_cache = torch.empty(cache_shape, dtype=self.dtype, device=self.device).normal_()
        block_tables = (
            torch.randperm(num_seqs * blocks_per_seq).view(num_seqs, -1).to(torch.int32).to(self.device)
        )
        query_start_loc = (torch.arange(num_seqs + 1) * chunk).to(torch.int32).to(self.device)
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=self.device)
        q = torch.randn((num_seqs * chunk, nh, hd), device=self.device).to(self.dtype)
        out = torch.empty_like(q)
        args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, hd**-0.5, out)
        ms = self.time_ms(lambda: pa.paged_attention(*args, max_query_len=chunk, max_seq_len=seq_len))
        # QK^T and PV, 2 flops per multiply-add, over the keys each query may see.
        visible_keys = num_seqs * sum(prefix + j + 1 for j in range(chunk))
        flops = 2 * 2 * visible_keys * nh * hd
        return [
            {
                "num_seqs": num_seqs,
                "prefix": prefix,
                "chunk": chunk,
                "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
            }
        ]

    def kv_write(self, copy_gbps: float) -> list[dict[str, Any]]:
        """write_kv_cache for the 1B model's layer (8 KV heads of 64) at decode batches and one
        prefill chunk, per launch variant (QWORKER_KV_WRITE), against the copy bandwidth and against
        a plain copy of the same bytes (a small write cannot beat a launch)."""
        torch = self.torch
        kv = _load_kernel_module("triton_kv_cache")
        dev, dt, bs = self.device, self.dtype, self.block_size
        kvh, hd = (2, 64) if self.interpret else (8, 64)
        rows = []
        for tokens in (4, 16) if self.interpret else (64, 256, 4096):
            k = torch.randn((tokens, kvh, hd), device=dev).to(dt)
            v = torch.randn_like(k)
            num_blocks = -(-tokens // bs) + 1
            k_cache = torch.zeros((num_blocks, bs, kvh, hd), device=dev, dtype=dt)
            v_cache = torch.zeros_like(k_cache)
            slot_mapping = torch.randperm(num_blocks * bs, device=dev)[:tokens]
            nbytes = 4 * k.numel() * k.element_size()  # read k and v, write both
            both = torch.cat([k, v]).flatten()
            dst = torch.empty_like(both)
            copy_ms = self.time_ms(lambda dst=dst, both=both: dst.copy_(both))
            for variant in kv.KV_WRITE_VARIANTS:
                ms = self.time_ms(
                    lambda k=k, v=v, kc=k_cache, vc=v_cache, sm=slot_mapping, variant=variant: (
                        kv.write_kv_cache(k, v, kc, vc, sm, variant=variant)
                    )
                )
                gbps = nbytes / (ms * 1e-3) / 1e9
                rows.append(
                    {"kernel": "write_kv_cache", "tokens": tokens, "variant": variant, "ms": ms, "gbps": gbps,
                     "fraction_of_copy": gbps / copy_gbps, "same_bytes_copy_ms": copy_ms,
                     "over_same_bytes_copy": ms / copy_ms}
                )  # fmt: skip
        return rows

    def elementwise(self, copy_gbps: float) -> list[dict[str, Any]]:
        torch = self.torch
        act = _load_kernel_module("triton_activation")
        kv = _load_kernel_module("triton_kv_cache")
        rn = _load_kernel_module("triton_rmsnorm")
        rot = _load_kernel_module("triton_rotary")
        dev, dt = self.device, self.dtype
        tokens, hidden, inter = (8, 256, 512) if self.interpret else (4096, 4096, 14336)
        nh, kvh, hd, bs = self.num_heads, self.num_kv_heads, self.head_dim, self.block_size
        esize = torch.empty((), dtype=dt).element_size()

        x = torch.randn((tokens, hidden), device=dev).to(dt)
        residual = torch.randn_like(x)
        weight = torch.randn(hidden, device=dev).to(dt)
        gate_up = torch.randn((tokens, 2 * inter), device=dev).to(dt)
        q = torch.randn((tokens, nh, hd), device=dev).to(dt)
        k = torch.randn((tokens, kvh, hd), device=dev).to(dt)
        v = torch.randn_like(k)
        positions = torch.randint(0, 4096, (tokens,), device=dev)
        angles = torch.rand((4096, hd // 2), device=dev)
        cos, sin = angles.cos(), angles.sin()
        num_blocks = -(-tokens // bs) + 1
        k_cache = torch.zeros((num_blocks, bs, kvh, hd), device=dev, dtype=dt)
        v_cache = torch.zeros_like(k_cache)
        slot_mapping = torch.randperm(num_blocks * bs, device=dev)[:tokens]

        cases: list[tuple[str, Callable[[], object], int]] = [
            ("rms_norm", lambda: rn.rms_norm(x, weight, 1e-6), 2 * x.numel() * esize),
            (
                "fused_add_rms_norm",
                lambda: rn.fused_add_rms_norm(x, residual, weight, 1e-6),
                4 * x.numel() * esize,
            ),
            ("silu_and_mul", lambda: act.silu_and_mul(gate_up), 3 * tokens * inter * esize),
            (
                "apply_rotary",
                lambda: rot.apply_rotary(q, k, positions, cos, sin),
                2 * (q.numel() + k.numel()) * esize + 2 * tokens * (hd // 2) * 4,
            ),
            (
                "write_kv_cache",
                lambda: kv.write_kv_cache(k, v, k_cache, v_cache, slot_mapping),
                4 * k.numel() * esize,
            ),
        ]
        rows = []
        for name, fn, nbytes in cases:
            ms = self.time_ms(fn)
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append({"kernel": name, "ms": ms, "gbps": gbps, "fraction_of_copy": gbps / copy_gbps})
        if self.check:  # one cheap sanity check that the timed kernels compute the right thing
            torch.testing.assert_close(act.silu_and_mul(gate_up), act.silu_and_mul_reference(gate_up))
            torch.testing.assert_close(rn.rms_norm(x, weight, 1e-6), rn.rms_norm_reference(x, weight, 1e-6))
        return rows


def _print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(value: object) -> str:
        return f"{value:.4g}" if isinstance(value, float) else ("-" if value is None else str(value))

    table = [[fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(cells[i]) for cells in table)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for cells in table:
        print("  ".join(text.rjust(w) for text, w in zip(cells, widths, strict=True)))


def main() -> int:
    args = _parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: read when kernels are decorated
    import torch
    import triton

    if not args.interpret and not torch.cuda.is_available():
        print(
            "bench_triton_kernels: no CUDA device, nothing to measure. "
            "Run with --interpret for a tiny CPU smoke run of the same code paths."
        )
        return 0
    bench = Bench(args)
    device_name = "cpu (TRITON_INTERPRET=1)" if args.interpret else torch.cuda.get_device_name()
    print(
        f"device: {device_name}  torch {torch.__version__}  triton {triton.__version__}  dtype {bench.dtype}"
    )
    copy_gbps = bench.copy_bandwidth_gbps()
    print(f"device-to-device copy: {copy_gbps:.1f} GB/s (read + write)")

    decode = bench.decode(copy_gbps, args.sweep_splits)
    decode_cols = ["batch", "context", "num_splits", "ms", "gbps", "fraction_of_copy", "max_abs_err",
                   "wave_num_splits", "wave_ms"]  # fmt: skip
    if args.sweep_splits:
        decode_cols.append("best_num_splits")
    _print_table(
        f"paged_decode_attention: heads {bench.num_heads}/{bench.num_kv_heads}, head_dim {bench.head_dim}, "
        f"block_size {bench.block_size}",
        decode,
        decode_cols,
    )
    prefill = bench.prefill()
    _print_table(
        "paged_attention (varlen chunked prefill)", prefill, ["num_seqs", "prefix", "chunk", "ms", "tflops"]
    )
    elementwise = bench.elementwise(copy_gbps)
    _print_table("elementwise kernels", elementwise, ["kernel", "ms", "gbps", "fraction_of_copy"])
    kv_write = bench.kv_write(copy_gbps)
    _print_table(
        "write_kv_cache by launch variant (the 1B layer, 8 KV heads x 64; 2 x 64 under --interpret)",
        kv_write,
        ["tokens", "variant", "ms", "gbps", "fraction_of_copy", "same_bytes_copy_ms"],
    )

    if args.json:
        result = {
            "device": device_name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "dtype": str(bench.dtype),
            "interpret": args.interpret,
            "copy_gbps": copy_gbps,
            "decode": decode,
            "prefill": prefill,
            "elementwise": elementwise,
            "kv_write": kv_write,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
