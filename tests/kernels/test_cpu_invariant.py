"""The batch-invariant CPU kernels: a row's bits do not depend on the rows beside it (GEMM), and a
token's attention output does not depend on the chunk or batch it is computed in."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from qworker_kernels import cpu_invariant_attention, cpu_invariant_gemm
from qworker_kernels.cpu_build import CKernelLibrary
from qworker_kernels.testing import cpu_flags

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not (cpu_invariant_gemm.is_available() and cpu_invariant_attention.is_available()),
        reason="no C compiler",
    ),
]

# 16 and 17: one whole AMX row tile and one row past it; 2048: many 128-row work items.
ROW_COUNTS = (1, 2, 7, 9, 16, 17, 64, 128, 256, 2048)


def _pack(weight: torch.Tensor, amx: bool) -> cpu_invariant_gemm.PackedInvariantWeight:
    """The weight packed for the AMX path (amx) or the AVX-512 / portable one."""
    if not amx:
        previous = os.environ.get("QWORKER_INVARIANT_GEMM_AMX")
        os.environ["QWORKER_INVARIANT_GEMM_AMX"] = "0"
        try:
            return cpu_invariant_gemm.pack_weight(weight)
        finally:
            if previous is None:
                del os.environ["QWORKER_INVARIANT_GEMM_AMX"]
            else:
                os.environ["QWORKER_INVARIANT_GEMM_AMX"] = previous
    packed = cpu_invariant_gemm.pack_weight(weight)
    assert packed.amx == cpu_invariant_gemm.amx_enabled()
    return packed


_AMX_PATHS = [
    False,
    pytest.param(
        True,
        marks=pytest.mark.skipif(
            not (cpu_invariant_gemm.is_available() and cpu_invariant_gemm.amx_enabled()),
            reason="no AMX tiles on this CPU, in this build or granted by the OS",
        ),
    ),
]


# The AMX path is bf16 only: fp32 runs the vector path.
_GEMM_PATHS = [
    pytest.param(torch.bfloat16, False, id="bf16-vector"),
    pytest.param(torch.bfloat16, *_AMX_PATHS[1].values, marks=_AMX_PATHS[1].marks, id="bf16-amx"),
    pytest.param(torch.float32, False, id="fp32-vector"),
]


@pytest.mark.parametrize(("dtype", "amx"), _GEMM_PATHS)
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (50, 33), (40, 70)])
def test_gemm_row_is_the_same_whatever_the_row_count(dtype: torch.dtype, n: int, k: int, amx: bool) -> None:
    gen = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    packed = _pack(weight, amx)
    assert packed.amx == amx
    row = torch.randn(1, k, generator=gen).to(dtype)
    alone = cpu_invariant_gemm.linear(row, packed, bias)
    reference = cpu_invariant_gemm.linear_reference(row, weight, bias)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(alone, reference, atol=tolerance, rtol=tolerance)
    for rows in ROW_COUNTS:
        for threads in (1, 2):
            batch = torch.randn(rows, k, generator=gen).to(dtype)
            where = rows // 2
            batch[where] = row[0]
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                out = cpu_invariant_gemm.linear(batch, packed, bias)
            finally:
                torch.set_num_threads(previous)
            assert torch.equal(out[where], alone[0]), f"row differs at {rows} rows, {threads} threads"
            # Every other row is right too (a tail row tile, a padded K chunk, a column tail).
            torch.testing.assert_close(
                out, cpu_invariant_gemm.linear_reference(batch, weight, bias), atol=tolerance, rtol=tolerance
            )


@pytest.mark.skipif(
    not (cpu_invariant_gemm.is_available() and cpu_invariant_gemm.amx_enabled()),
    reason="no AMX tiles on this CPU, in this build or granted by the OS",
)
def test_gemm_amx_rows_at_every_offset_of_a_tile() -> None:
    """The same row at every position of 16- and 32-row tiles, among rows of any magnitude, on a
    strided input (a view of a wider tensor, as the model's fused projections hand over)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 200, 576
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    packed = _pack(weight, True)
    row = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    alone = cpu_invariant_gemm.linear(row, packed)
    for rows in (33, 48):
        wide = (torch.randn(rows, k + 64, generator=gen) * 100).to(torch.bfloat16)
        batch = wide[:, :k]
        for where in range(rows):
            saved = batch[where].clone()
            batch[where] = row[0]
            out = cpu_invariant_gemm.linear(batch, packed)
            assert torch.equal(out[where], alone[0]), f"row {where} of {rows} differs"
            batch[where] = saved


def _cache(dtype: torch.dtype, blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (blocks, 16, 3, 64)  # [blocks, block_size, KVH, D]
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("amx", [True, False], ids=["amx-if-any", "no-amx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (37, 30.0)])
def test_attention_token_is_the_same_in_any_chunk_or_batch(
    dtype: torch.dtype, window: int | None, cap: float | None, amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bf16 runs on AMX tiles where the CPU, the build and the OS allow it (amx-if-any), else (and
    # with no-amx) on VDPBF16PS or fp32 FMAs: each path must hold on its own.
    monkeypatch.setenv("QWORKER_INVARIANT_ATTENTION_AMX", "1" if amx else "0")
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = _cache(dtype, 32, gen)
    order = torch.randperm(32, generator=gen)
    tables = torch.stack([order[:16], order[16:]]).to(torch.int32)
    length = 150
    q = torch.randn(length, 9, 64, generator=gen).to(dtype)
    seq = torch.zeros(length, dtype=torch.int32)
    pos = torch.arange(length, dtype=torch.int32)
    extras = {"sliding_window": window, "logits_soft_cap": cap}
    whole = cpu_invariant_attention.paged_attention(q, k_cache, v_cache, tables, seq, pos, 0.125, **extras)
    reference = cpu_invariant_attention.paged_attention_reference(
        q, k_cache, v_cache, tables, seq, pos, 0.125, **extras
    )
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(whole, reference, atol=tolerance, rtol=tolerance)
    # Decode steps: one token at a time.
    for t in (0, 15, 16, 17, 99, length - 1):
        one = cpu_invariant_attention.paged_attention(
            q[t : t + 1], k_cache, v_cache, tables, seq[t : t + 1], pos[t : t + 1], 0.125, **extras
        )
        assert torch.equal(one[0], whole[t]), f"decode of position {t} differs from the prefill"
    # Chunks of 7 beside another sequence's tokens.
    other = torch.randn(5, 9, 64, generator=gen).to(dtype)
    for start in range(0, length, 7):
        stop = min(start + 7, length)
        mixed_q = torch.cat([other, q[start:stop]])
        mixed_seq = torch.cat([torch.ones(5, dtype=torch.int32), seq[start:stop]])
        mixed_pos = torch.cat([torch.arange(200, 205, dtype=torch.int32), pos[start:stop]])
        mixed = cpu_invariant_attention.paged_attention(
            mixed_q, k_cache, v_cache, tables, mixed_seq, mixed_pos, 0.125, **extras
        )
        assert torch.equal(mixed[5:], whole[start:stop]), f"chunk at {start} differs"


@pytest.mark.parametrize("amx", [True, False], ids=["amx-if-any", "no-amx"])
def test_attention_other_shapes_and_block_sizes(amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """head_dim 128 with 4 query heads per KV head, blocks of 5 slots (a 16- or 32-key tile spans
    several blocks) and a cached prefix: decode steps, the whole prompt and chunks of 13 agree."""
    monkeypatch.setenv("QWORKER_INVARIANT_ATTENTION_AMX", "1" if amx else "0")
    gen = torch.Generator().manual_seed(11)
    dtype, block, length = torch.bfloat16, 5, 101
    shape = (48, block, 2, 128)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.randperm(48, generator=gen)[:21].to(torch.int32)[None]
    q = torch.randn(length, 8, 128, generator=gen).to(dtype)
    seq = torch.zeros(length, dtype=torch.int32)
    pos = torch.arange(length, dtype=torch.int32)
    scale = 128**-0.5
    whole = cpu_invariant_attention.paged_attention(q, k_cache, v_cache, tables, seq, pos, scale)
    reference = cpu_invariant_attention.paged_attention_reference(
        q, k_cache, v_cache, tables, seq, pos, scale
    )
    torch.testing.assert_close(whole, reference, atol=2e-2, rtol=2e-2)
    for t in (0, 31, 32, 33, 64, length - 1):
        one = cpu_invariant_attention.paged_attention(
            q[t : t + 1], k_cache, v_cache, tables, seq[t : t + 1], pos[t : t + 1], scale
        )
        assert torch.equal(one[0], whole[t]), f"decode of position {t} differs from the prefill"
    for start in range(40, length, 13):  # a prefix of 40 tokens "from the cache"
        stop = min(start + 13, length)
        chunk = cpu_invariant_attention.paged_attention(
            q[start:stop], k_cache, v_cache, tables, seq[start:stop], pos[start:stop], scale
        )
        assert torch.equal(chunk, whole[start:stop]), f"chunk at {start} differs"


def test_token_positions() -> None:
    seq_lens = torch.tensor([5, 9, 3], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 4, 7], dtype=torch.int32)
    seq, pos = cpu_invariant_attention.token_positions(seq_lens, query_start_loc)
    assert seq.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert pos.tolist() == [4, 6, 7, 8, 0, 1, 2]


@pytest.mark.skipif(
    not {"avx2", "fma"} <= cpu_flags() or "avx512f" in cpu_flags(),
    reason="the AVX2 path runs on AVX2-only CPUs",
)
def test_the_avx2_path_gives_the_portable_paths_bf16_bits():
    """bf16 products are exact in fp32, so the AVX2 path's FMAs round as the portable path's
    multiply-then-add: the same bits as a build of the same source without AVX2 and FMA."""
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    gemm_args = [p, i64, p, p, p, i64, i64, i64, i64, i, i, i]
    portable = CKernelLibrary(
        "cpu_invariant_gemm.c", {"qw_inv_gemm": gemm_args}, {}, ("-ffp-contract=off", "-mno-avx2", "-mno-fma")
    )
    lib = portable.get()
    if lib is None:
        pytest.skip("the compiler cannot build without AVX2")
    gemm = lib.qw_inv_gemm
    torch.manual_seed(0)
    for n, k in ((96, 576), (40, 37)):  # 37: an odd K, the last pair's second element zero
        weight, bias = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n)
        x = torch.randn(13, k, dtype=torch.bfloat16)
        packed = _pack(weight, amx=False)
        out = torch.empty(13, n, dtype=torch.bfloat16)
        status = gemm(
            x.data_ptr(), k, packed.data.data_ptr(), bias.data_ptr(), out.data_ptr(), n, 13, n, k, 1, 0, 1
        )
        assert status == 0
        assert torch.equal(cpu_invariant_gemm.linear(x, packed, bias), out)
