"""CPU paged decode attention: the C kernel and the torch fallback against the plain reference."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import qworker_kernels.cpu_paged_attention as cpa
import torch
from qworker_kernels.testing import cpu_flags

needs_kernel = pytest.mark.skipif(not cpa.is_available(), reason="no C compiler: C kernel not built")

Attention = Callable[..., torch.Tensor]
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


def make_inputs(
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
    extra_table_cols: int = 2,
) -> tuple[torch.Tensor, ...]:
    """Random q and pool, and block tables of shuffled block ids padded with random valid ids."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs, num_heads = len(seq_lens), num_kv_heads * group
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + extra_table_cols
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.randint(0, num_blocks, (num_seqs, max_blocks), generator=gen, dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = ids[start : start + count]
        start += count
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def lens_for(block_size: int) -> list[int]:
    # 1 token, exactly one block, one more than a block, several blocks, long enough for several
    # 32-token chunks with a ragged end; mixed in one batch.
    return [1, block_size, block_size + 1, 3 * block_size + 5, 4 * block_size, 97, 2]


def check(fn: Attention, inputs: tuple[torch.Tensor, ...], dtype: torch.dtype, scale: float) -> None:
    expected = cpa.paged_decode_attention_float64_reference(*inputs, scale)
    actual = fn(*inputs, scale)
    assert actual.dtype == dtype and actual.shape == inputs[0].shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


IMPLEMENTATIONS = [
    pytest.param(cpa.paged_decode_attention, marks=needs_kernel, id="c"),
    pytest.param(cpa.paged_decode_attention_torch, id="torch"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_matches_reference(
    fn: Attention, dtype: torch.dtype, block_size: int, head_dim: int, group: int
) -> None:
    inputs = make_inputs(lens_for(block_size), 2, group, head_dim, block_size, dtype)
    check(fn, inputs, dtype, head_dim**-0.5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [2, 4, 5, 7])
@pytest.mark.parametrize("head_dim", [16, 48, 96, 80])
def test_odd_groups_and_head_dims(fn: Attention, dtype: torch.dtype, group: int, head_dim: int) -> None:
    # Groups that leave 1 or 2 heads after tiles of 3; head_dims that leave column tails (80 is not
    # a multiple of 16: the C entry point hands it to the torch path).
    inputs = make_inputs([5, 33, 70], 1, group, head_dim, 16, dtype, seed=group)
    check(fn, inputs, dtype, 0.3)


def window_lens(window: int, block_size: int) -> list[int]:
    # Contexts shorter than, equal to and longer than the window (by one and by several blocks),
    # in one batch.
    return [1, max(1, window - 1), window, window + 1, window + 3 * block_size + 5, 2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [48, 64, 80, 128])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize(("window", "soft_cap"), [(1, None), (37, None), (16, 2.5), (None, 2.5)])
def test_sliding_window_and_soft_cap(
    fn: Attention,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    group: int,
    window: int | None,
    soft_cap: float | None,
) -> None:
    lens = window_lens(window or 40, block_size)
    inputs = make_inputs(lens, 2, group, head_dim, block_size, dtype, seed=head_dim + group)
    # Scores of a few units, so that a cap of 2.5 bends most of them.
    scale = 3 * head_dim**-0.5
    extras = {"sliding_window": window, "logits_soft_cap": soft_cap}
    expected = cpa.paged_decode_attention_float64_reference(*inputs, scale, **extras)
    actual = fn(*inputs, scale, **extras)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])
    if window is not None:  # the window changes the answer wherever it cuts a context short
        full = cpa.paged_decode_attention_float64_reference(*inputs, scale, logits_soft_cap=soft_cap)
        cut = torch.tensor(lens) > window
        assert not torch.allclose(actual[cut].float(), full[cut].float(), **TOLERANCE[dtype])


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_windowed_long_sequences_split_across_threads(num_threads: int) -> None:
    # Few long sequences: the kernel splits each window into parts and merges them.
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        inputs = make_inputs([2000, 1, 700], 3, 3, 64, 16, torch.float32, seed=4)
        for window in (100, 333, 5000):
            expected = cpa.paged_decode_attention_float64_reference(*inputs, 0.125, sliding_window=window)
            actual = cpa.paged_decode_attention(*inputs, 0.125, sliding_window=window)
            torch.testing.assert_close(actual, expected, **TOLERANCE[torch.float32])
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "extras",
    [
        {"sliding_window": 0},
        {"sliding_window": 2.5},
        {"logits_soft_cap": 0.0},
        {"logits_soft_cap": float("inf")},
    ],
    ids=["window 0", "window float", "cap 0", "cap inf"],
)
def test_rejects_bad_extras(fn: Attention, extras: dict) -> None:
    inputs = make_inputs([5, 17], 2, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match=r"sliding_window|logits_soft_cap"):
        fn(*inputs, 0.125, **extras)


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_long_sequences_split_across_threads(dtype: torch.dtype, num_threads: int) -> None:
    # Few sequences: the kernel splits them into parts and merges the partial softmaxes.
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        inputs = make_inputs([2000, 1, 700], 3, 3, 64, 16, dtype, seed=1)
        check(cpa.paged_decode_attention, inputs, dtype, 0.125)
        inputs = make_inputs([1500], 2, 4, 128, 32, dtype, seed=2)
        check(cpa.paged_decode_attention, inputs, dtype, 0.1)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.timeout(120)
def test_big_batch_bf16() -> None:
    # SmolLM2-135M's shapes at a batch the scheduler would run.
    lens = [int(x) for x in torch.randint(1, 300, (64,), generator=torch.Generator().manual_seed(3))]
    inputs = make_inputs(lens, 3, 3, 64, 16, torch.bfloat16, seed=3)
    check(cpa.paged_decode_attention, inputs, torch.bfloat16, 0.125)


@needs_kernel
@pytest.mark.timeout(60)
def test_large_scores_stay_finite() -> None:
    # Scores in the hundreds: the online softmax must subtract the running max.
    q, k, v, bt, sl = make_inputs([300, 40], 2, 2, 64, 16, torch.float32)
    inputs = (q * 30, k * 3, v, bt, sl)
    expected = cpa.paged_decode_attention_float64_reference(*inputs, 1.0)
    actual = cpa.paged_decode_attention(*inputs, 1.0)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


# The same source built with the generic vector code forced: on CPUs with AVX512-BF16 the module's
# build takes the AVX512-BF16 path for bf16, and the two are compared below.
GENERIC_BUILD = cpa.kernel_build(extra_flags=("-DQW_DECODE_GENERIC",))


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits), for x in fp32."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


def _within_one_bf16_step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| <= one bf16 step at their magnitude, plus 1e-5 for outputs near zero, where terms of
    order 1 cancel and the two fp32 summation orders differ by more than a step of the result."""
    return (a - b).abs() <= _bf16_ulp(torch.maximum(a.abs(), b.abs())) + 1e-5


@needs_kernel
@pytest.mark.timeout(60)
def test_bf16_variant_follows_the_cpu() -> None:
    # The AVX512-BF16 path is built on the CPUs with AVX512-BF16 (the AMX Xeons and the AVX512-BF16
    # EPYC, where it was measured); AVX2 machines keep the generic code. The tests of this module
    # then run whichever path this machine ships.
    fast = {"avx512_bf16", "avx512bw"} <= cpu_flags()
    assert cpa.bf16_variant() == ("avx512-bf16" if fast else "generic")
    assert cpa.bf16_variant(GENERIC_BUILD) == "generic"


@needs_kernel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize(("head_dim", "group"), [(16, 2), (48, 4), (64, 3), (96, 9), (128, 1)])
def test_bf16_every_chunk_length_against_generic_code(block_size: int, head_dim: int, group: int) -> None:
    # Every length 1..70 in one batch: each remainder of the 16-token score tiles and the 32-token
    # chunks, tiles straddling blocks (block size 5), head dims with 16- and 32-column tails, groups
    # that leave 0, 1 or 2 heads after tiles of 3. Both builds accumulate in fp32 and round once to
    # bf16, so they may differ by one bf16 step where that rounding falls differently.
    lens = list(range(1, 71))
    inputs = make_inputs(lens, 2, group, head_dim, block_size, torch.bfloat16, seed=head_dim + block_size)
    scale = head_dim**-0.5
    expected = cpa.paged_decode_attention_float64_reference(*inputs, scale)
    actual = cpa.paged_decode_attention(*inputs, scale)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[torch.bfloat16])
    generic = cpa.paged_decode_attention(*inputs, scale, library=GENERIC_BUILD).float()
    assert _within_one_bf16_step(actual.float(), generic).all()
    assert (actual.float() != generic).float().mean() < 0.01  # rounding flips are rare, not the rule


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_bf16_extras_and_splits_against_generic_code(num_threads: int) -> None:
    # Soft-cap, window and split sequences (merged partial softmaxes) through both builds.
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        inputs = make_inputs([2000, 1, 700, 45], 3, 3, 64, 16, torch.bfloat16, seed=7)
        for extras in ({}, {"sliding_window": 333}, {"logits_soft_cap": 2.5, "sliding_window": 50}):
            expected = cpa.paged_decode_attention_float64_reference(*inputs, 0.3, **extras)
            actual = cpa.paged_decode_attention(*inputs, 0.3, **extras).float()
            torch.testing.assert_close(actual, expected.float(), **TOLERANCE[torch.bfloat16])
            generic = cpa.paged_decode_attention(*inputs, 0.3, library=GENERIC_BUILD, **extras).float()
            assert _within_one_bf16_step(actual, generic).all()
    finally:
        torch.set_num_threads(before)


# Builds for the other machine kinds, run here where this CPU can execute them, with the bf16 code
# each must take: the AVX2 EPYC (x86-64-v3) and the x86-64 baseline the generic code, an
# AVX512-BF16 CPU without AMX like the AVX512-BF16 EPYC (cooperlake: GCC 12 has no znver4) the
# AVX512-BF16 path.
OTHER_TARGETS = {
    "x86-64-v3": ("x86-64-v3", {"avx2", "fma"}, "generic"),
    "avx512bf16-no-amx": ("cooperlake", {"avx512f", "avx512bw", "avx512_bf16", "avx512vl"}, "avx512-bf16"),
    "x86-64": ("x86-64", set(), "generic"),
}


@needs_kernel
@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", sorted(OTHER_TARGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_other_targets_take_their_bf16_code(target: str, dtype: torch.dtype) -> None:
    march, needs, variant = OTHER_TARGETS[target]
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run a -march={march} build")
    build = cpa.kernel_build(extra_flags=(f"-march={march}",))
    if build.get() is None:
        pytest.skip(f"the compiler cannot build -march={march}")
    assert cpa.bf16_variant(build) == variant
    for head_dim, group in ((64, 3), (48, 4)):
        inputs = make_inputs(lens_for(16), 2, group, head_dim, 16, dtype, seed=head_dim)
        expected = cpa.paged_decode_attention_float64_reference(*inputs, 0.2)
        actual = cpa.paged_decode_attention(*inputs, 0.2, library=build)
        torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


@needs_kernel
@pytest.mark.timeout(60)
def test_large_scores_stay_finite_bf16() -> None:
    # Scores in the hundreds in bf16: the raw-q dot products and the scale applied after them.
    q, k, v, bt, sl = make_inputs([300, 40], 2, 2, 64, 16, torch.bfloat16)
    inputs = (q * 30, k * 3, v, bt, sl)
    expected = cpa.paged_decode_attention_float64_reference(*inputs, 1.0)
    actual = cpa.paged_decode_attention(*inputs, 1.0)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
def test_writes_into_out(fn: Attention) -> None:
    inputs = make_inputs([3, 20], 1, 2, 64, 16, torch.float32)
    out = torch.full_like(inputs[0], float("nan"))
    result = fn(*inputs, 0.125, out=out)
    assert result is out
    torch.testing.assert_close(
        out, cpa.paged_decode_attention_float64_reference(*inputs, 0.125), atol=2e-5, rtol=2e-5
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
def test_empty_batch(fn: Attention) -> None:
    q, k, v, _, _ = make_inputs([4], 1, 1, 64, 16, torch.float32)
    out = fn(q[:0], k, v, torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0.1)
    assert out.shape == (0, 1, 64)


def _bad_inputs() -> dict[str, tuple]:
    q, k, v, bt, sl = make_inputs([5, 17], 2, 2, 64, 16, torch.float32)
    wide = torch.randn(k.shape[0], k.shape[1], k.shape[2] * 2, 64)
    return {
        "q transposed": (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, bt, sl),
        "k_cache strided": (q, k, wide[:, :, ::2], bt, sl),
        "v_cache strided": (q, k, wide[:, :, 1::2], bt, sl),
        "block_tables strided": (q, k, v, bt.t().contiguous().t(), sl),
        "block_tables int64": (q, k, v, bt.long(), sl),
        "seq_lens int64": (q, k, v, bt, sl.long()),
        "q fp16": (q.half(), k.half(), v.half(), bt, sl),
        "dtype mismatch": (q.bfloat16(), k, v, bt, sl),
        "head_dim mismatch": (q[:, :, :32].contiguous(), k, v, bt, sl),
        "heads not a multiple": (q[:, :3].contiguous(), k, v, bt, sl),
        "v shape": (q, k, v[:, :8].contiguous(), bt, sl),
        "num_seqs mismatch": (q, k, v, bt[:1], sl),
        "seq_len zero": (q, k, v, bt, torch.tensor([0, 17], dtype=torch.int32)),
        "seq_len past table": (q, k, v, bt, torch.tensor([5, 16 * bt.shape[1] + 1], dtype=torch.int32)),
        "block id out of range": (q, k, v, torch.full_like(bt, k.shape[0]), sl),
        "negative block id": (q, k, v, torch.full_like(bt, -1), sl),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_rejects_bad_inputs(fn: Attention, case: str) -> None:
    if case == "q fp16" and fn is cpa.paged_decode_attention_torch:
        # Not bad input for the fallback: it serves fp16 (test_torch_fallback_serves_fp16).
        assert fn(*_bad_inputs()[case], 0.125).dtype == torch.float16
        return
    with pytest.raises(ValueError):
        fn(*_bad_inputs()[case], 0.125)


@pytest.mark.timeout(60)
def test_torch_fallback_serves_fp16() -> None:
    # The engine's torch backend uses the fallback on CUDA too, where models often run in fp16.
    inputs = make_inputs(lens_for(16), 2, 3, 64, 16, torch.float16)
    expected = cpa.paged_decode_attention_float64_reference(*inputs, 0.125)
    actual = cpa.paged_decode_attention_torch(*inputs, 0.125)
    assert actual.dtype == torch.float16
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
def test_rejects_bad_out(fn: Attention) -> None:
    q, k, v, bt, sl = make_inputs([5, 17], 2, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError):
        fn(q, k, v, bt, sl, 0.1, out=torch.empty(2, 64, 4).transpose(1, 2))
    with pytest.raises(ValueError):
        fn(q, k, v, bt, sl, 0.1, out=torch.empty_like(q, dtype=torch.bfloat16))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", IMPLEMENTATIONS)
def test_padding_entries_are_ignored(fn: Attention) -> None:
    # Entries past a sequence's blocks may hold any id, even out of range: they are never read.
    q, k, v, bt, sl = make_inputs([5, 17], 2, 2, 64, 16, torch.float32)
    expected = fn(q, k, v, bt, sl, 0.1)
    bt[0, 1:] = 10**6
    bt[1, 2:] = -7
    torch.testing.assert_close(fn(q, k, v, bt, sl, 0.1), expected)


_BUILD_SCRIPT = "import qworker_kernels.cpu_paged_attention as m; print(m.is_available())"


@needs_kernel
@pytest.mark.timeout(120)
def test_concurrent_first_builds_share_one_cache(tmp_path: Path) -> None:
    # Two processes build at the same moment into an empty QWORKER_CACHE_DIR: both must load a
    # whole library (each builds to a temp file and renames it into place).
    env = {**os.environ, "QWORKER_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD_SCRIPT],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=100)[0].strip() for p in procs]
    assert outputs == ["True", "True"]
    built = list(tmp_path.glob("kernels/*/cpu_paged_attention.so"))
    assert len(built) == 1
    assert not list(tmp_path.glob("kernels/*/.build-*")), "temporary build files left behind"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 37, 2048])
def test_write_kv_cache_matches_index_copy(dtype: torch.dtype, num_tokens: int) -> None:
    from qworker.model.attention import write_kv_cache_torch

    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks, block_size, num_kv_heads, head_dim = 200, 16, 3, 64
    # v as the model hands it over: a strided view into a fused qkv output.
    qkv = torch.randn(num_tokens, (9 + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = qkv[:, (9 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    caches = [
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv"
    ]
    expected = [c.clone() for c in caches]
    write_kv_cache_torch(k, v, *expected, slots)
    cpa.write_kv_cache(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@needs_kernel
def test_write_kv_cache_rejects_slots_outside_the_pool_and_writes_nothing() -> None:
    k_cache, v_cache = torch.zeros(4, 2, 1, 16), torch.zeros(4, 2, 1, 16)
    k, v = torch.ones(2, 1, 16), torch.ones(2, 1, 16)
    with pytest.raises(ValueError, match="outside"):
        cpa.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([3, 8]))
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(ValueError, match="packed heads"):
        cpa.write_kv_cache(k.transpose(1, 2), v, k_cache, v_cache, torch.tensor([0, 1]))
