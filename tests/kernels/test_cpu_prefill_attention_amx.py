"""The CPU paged prefill attention kernel's AMX path (bf16, TDPBF16PS tiles) against a float64
reference: ragged prompts, chunks over a cached prefix, GQA, head_dim 64 to 256, block sizes 16 and
32, sliding windows and soft-capping, one and two threads; and against the VDPBF16PS path it
replaces. Skipped on a CPU without amx_bf16."""

from __future__ import annotations

import pytest
import torch
from qworker_kernels import cpu_prefill_attention as kernel
from qworker_kernels.testing import cpu_flags, make_paged_batch

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not kernel.is_available(), reason="no C compiler to build the CPU kernels"),
    pytest.mark.skipif(
        "amx_bf16" not in cpu_flags(), reason="the CPU has no amx_bf16: the AMX path is not built"
    ),
]

TOLERANCE = 2e-2  # as the kernel's other bf16 tests: bf16 inputs, probabilities rounded to bf16


def test_amx_path_is_taken():
    # On an AMX CPU the kernel is built for AMX and Linux grants the tile state: if this fails, every
    # other test here checks the VDPBF16PS path instead.
    assert kernel.amx_available()


def _run(seqs, *, head_dim, num_heads, num_kv_heads, block_size, scale=None, allow_amx=True, **extras):
    batch = make_paged_batch(
        seqs,
        block_size=block_size,
        head_dim=head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=torch.bfloat16,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    scale = batch.scale if scale is None else scale
    out = torch.full_like(batch.q, float("nan"))
    kernel.paged_prefill_attention(*args, 0, len(seqs), scale, out, allow_amx=allow_amx, **extras)
    want = kernel.paged_prefill_attention_reference(*args, 0, len(seqs), scale, **extras)
    return out, want


CASES = {
    # (cached prefix, chunk) per sequence
    "ragged": [(0, 1), (0, 15), (0, 16), (0, 17), (0, 33), (0, 64), (0, 65), (0, 300)],
    "chunked": [(512, 64), (100, 33), (1500, 100), (31, 200), (63, 1), (64, 2)],
    "one-long": [(0, 777)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads"), [(64, 9, 3), (64, 4, 4), (128, 8, 2), (128, 4, 1)]
)
def test_matches_reference(case, block_size, head_dim, num_heads, num_kv_heads, threads):
    out, want = _run(
        CASES[case], head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("head_dim", [32, 96, 160, 256])
def test_other_head_dims(head_dim, threads):
    out, want = _run(CASES["chunked"], head_dim=head_dim, num_heads=4, num_kv_heads=2, block_size=16)
    torch.testing.assert_close(out, want, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("window", "soft_cap"), [(1, None), (37, None), (64, 2.5), (None, 2.5), (400, None)])
def test_sliding_window_and_soft_cap(block_size, window, soft_cap, threads):
    seqs = [(0, 100), (0, 7), (200, 33), (20, 50), (0, 1), (300, 1), (700, 130)]
    extras = {"sliding_window": window, "logits_soft_cap": soft_cap}
    # Scores of a few units: a cap of 2.5 bends most of them.
    out, want = _run(
        seqs, head_dim=64, num_heads=8, num_kv_heads=2, block_size=block_size, scale=3 / 8, **extras
    )
    torch.testing.assert_close(out, want, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("soft_cap", [None, 2.5])
def test_as_accurate_as_the_vdpbf16ps_path(soft_cap):
    # Both paths round the same bf16 inputs and probabilities; only the order of the fp32 sums and
    # the exp differ. An error the 2e-2 tolerance cannot see (a 1% bias of the probabilities, say)
    # shows as a larger mean error against the reference. Deterministic inputs: not flaky.
    kwargs = {"head_dim": 64, "num_heads": 9, "num_kv_heads": 3, "block_size": 16, "scale": 3 / 8}
    amx, want = _run(CASES["chunked"], logits_soft_cap=soft_cap, **kwargs)
    vdp, _ = _run(CASES["chunked"], logits_soft_cap=soft_cap, allow_amx=False, **kwargs)
    torch.testing.assert_close(amx, vdp, atol=TOLERANCE, rtol=TOLERANCE)
    amx_error = (amx.float() - want.float()).abs().mean()
    vdp_error = (vdp.float() - want.float()).abs().mean()
    assert amx_error <= 1.2 * vdp_error, (amx_error, vdp_error)


def test_only_the_given_sequences_are_written():
    batch = make_paged_batch(
        [(0, 3), (40, 50), (0, 70)],
        block_size=16,
        head_dim=64,
        num_heads=4,
        num_kv_heads=2,
        dtype=torch.bfloat16,
    )
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    out = torch.full_like(batch.q, 7.0)
    kernel.paged_prefill_attention(*args, 1, 3, batch.scale, out)
    assert torch.all(out[:3] == 7.0)
    want = kernel.paged_prefill_attention_reference(*args, 1, 3, batch.scale)
    torch.testing.assert_close(out[3:], want[3:], atol=TOLERANCE, rtol=TOLERANCE)
