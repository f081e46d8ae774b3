"""The CPU paged prefill attention kernel against a float64 reference: chunks with and without a
cached prefix, odd lengths, GQA, several sequences in one call, a sequence range, both dtypes, one
and two threads; and the launcher's checks."""

from __future__ import annotations

import pytest
import torch
from qworker_kernels import cpu_prefill_attention as kernel
from qworker_kernels.testing import make_paged_batch

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not kernel.is_available(), reason="no C compiler to build the CPU kernels"),
]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


CASES = [
    # (cached prefix, chunk) per sequence
    [(0, 1)],
    [(0, 37)],
    [(0, 300)],
    [(5, 1), (0, 17)],  # a decode-like chunk beside a prompt
    [(100, 33), (0, 64), (31, 200), (0, 2)],
    [(512, 16)],  # a late chunk of a long prompt
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (4, 4, 32, 5)]
)
def test_matches_reference(seqs, dtype, num_heads, num_kv_heads, head_dim, block_size, threads):
    batch = make_paged_batch(
        seqs,
        block_size=block_size,
        head_dim=head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    out = torch.full_like(batch.q, float("nan"))
    kernel.paged_prefill_attention(*args, 0, len(seqs), batch.scale, out)
    want = kernel.paged_prefill_attention_reference(*args, 0, len(seqs), batch.scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


WINDOW_CASES = [
    # (cached prefix, chunk) per sequence: chunks shorter and longer than the window, with and
    # without a cached prefix longer than it, and a chunk that starts inside the window
    [(0, 100), (0, 7), (200, 33), (20, 50), (0, 1), (300, 1)],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads"), [(48, 4, 4), (64, 8, 2), (80, 2, 2), (128, 4, 1)]
)
@pytest.mark.parametrize(("window", "soft_cap"), [(1, None), (37, None), (64, 2.5), (None, 2.5), (400, None)])
def test_sliding_window_and_soft_cap(dtype, block_size, head_dim, num_heads, num_kv_heads, window, soft_cap):
    seqs = WINDOW_CASES[0]
    batch = make_paged_batch(
        seqs,
        block_size=block_size,
        head_dim=head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    scale = 3 * head_dim**-0.5  # scores of a few units: a cap of 2.5 bends most of them
    extras = {"sliding_window": window, "logits_soft_cap": soft_cap}
    out = torch.full_like(batch.q, float("nan"))
    kernel.paged_prefill_attention(*args, 0, len(seqs), scale, out, **extras)
    want = kernel.paged_prefill_attention_reference(*args, 0, len(seqs), scale, **extras)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    if window is not None and window < 300:  # some query's context is longer than the window
        full = kernel.paged_prefill_attention_reference(*args, 0, len(seqs), scale, logits_soft_cap=soft_cap)
        assert not torch.allclose(out.float(), full.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_on_two_threads(dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        test_sliding_window_and_soft_cap(dtype, 16, 64, 8, 2, 37, 2.5)
    finally:
        torch.set_num_threads(before)


def test_only_the_given_sequences_are_written():
    batch = make_paged_batch(
        [(0, 3), (4, 5), (0, 6)], block_size=4, head_dim=16, num_heads=2, num_kv_heads=1, dtype=torch.float32
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    out = torch.full_like(batch.q, 7.0)
    kernel.paged_prefill_attention(*args, 1, 3, batch.scale, out)
    assert torch.all(out[:3] == 7.0)
    want = kernel.paged_prefill_attention_reference(*args, 1, 3, batch.scale)
    torch.testing.assert_close(out[3:], want[3:], atol=1e-4, rtol=1e-4)


def test_launcher_and_kernel_reject_bad_inputs():
    batch = make_paged_batch(
        [(2, 3)], block_size=4, head_dim=16, num_heads=2, num_kv_heads=1, dtype=torch.float32
    )
    args = [batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc]
    out = torch.empty_like(batch.q)
    with pytest.raises(ValueError, match="range"):
        kernel.paged_prefill_attention(*args, 0, 2, batch.scale, out)
    bad_tables = batch.block_tables.clone()
    bad_tables[0, 0] = 1000
    with pytest.raises(ValueError, match="block id"):
        kernel.paged_prefill_attention(*args[:3], bad_tables, *args[4:], 0, 1, batch.scale, out)
    too_long = batch.seq_lens + 100
    with pytest.raises(ValueError, match="context"):
        kernel.paged_prefill_attention(*args[:4], too_long, args[5], 0, 1, batch.scale, out)
    with pytest.raises(ValueError, match="head_dim"):
        q = torch.randn(3, 2, 8)
        cache = torch.randn(4, 4, 1, 8)
        kernel.paged_prefill_attention(q, cache, cache, *args[3:], 0, 1, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="sliding_window"):
        kernel.paged_prefill_attention(*args, 0, 1, batch.scale, out, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        kernel.paged_prefill_attention(*args, 0, 1, batch.scale, out, logits_soft_cap=-1.0)
