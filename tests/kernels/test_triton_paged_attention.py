# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
from typing import Any

import pytest
import qworker_kernels.triton_paged_attention as pa
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from qworker_kernels.testing import (
    EXTRAS_SCALE_FACTOR,
    PagedBatch,
    attention_extras_cases,
    decode_seqs,
    make_paged_batch,
    varlen_seqs,
)
from qworker_kernels.triton_common import DOT_FP32_IEEE, DOT_NATIVE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(120)

TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def make_batch(seqs: list[tuple[int, int]], **shape: Any) -> PagedBatch:
    """(cached prefix length, query length) per sequence; NaN in every slot no sequence may read."""
    return make_paged_batch(seqs, device=DEVICE, **shape)


def run_varlen(b: PagedBatch, **kwargs: object) -> torch.Tensor:
    return pa.paged_attention(*b.varlen_args, **kwargs)


def reference(b: PagedBatch) -> torch.Tensor:
    return pa.paged_attention_reference(*b.varlen_args)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "NaN in the output: a masked slot was read"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


# (block_size, head_dim, num_heads, num_kv_heads, seqs as (cached prefix, query len), dtype,
#  max_query_len passed to the launcher or None). Together they cover block sizes 16/32, head
# dims 64/128 (and an odd 80), GQA ratios 1/3/8, contexts of 1, one block, one block + 1 and
# several blocks, chunks of 1/7/64 tokens with and without a cached prefix, and each dtype.
VARLEN_CASES = {
    "prefill_from_empty_bs16_hd64_mha": (16, 64, 2, 2, [(0, 7), (0, 64), (0, 1)], torch.float32, None),
    "prefill_bm64_tiles_bs16_hd64_mha": (16, 64, 2, 2, [(0, 64), (0, 7), (9, 1)], torch.float32, 64),
    "chunks_after_prefix_bs16_hd128_gqa3": (
        16,
        128,
        6,
        2,
        [(16, 7), (17, 64), (40, 1), (5, 7), (31, 1)],
        torch.float32,
        None,
    ),
    "contexts_edge_bs32_hd64_gqa8": (32, 64, 8, 1, [(0, 1), (31, 1), (32, 1), (90, 7)], torch.float32, None),
    "mixed_bs32_hd128_gqa8_chunk64": (32, 128, 8, 1, [(33, 64), (0, 1), (70, 1)], torch.float32, 64),
    "mixed_bs16_hd128_mha_bf16": (16, 128, 2, 2, [(3, 1), (0, 7), (20, 64), (47, 1)], torch.bfloat16, None),
    "mixed_bs32_hd64_gqa3_fp16": (32, 64, 3, 1, [(32, 7), (0, 1), (64, 64)], torch.float16, 64),
    "mixed_bs16_hd64_gqa8_bf16": (16, 64, 8, 1, [(16, 7), (1, 1)], torch.bfloat16, None),
    "odd_head_dim80_gqa3": (16, 80, 6, 2, [(10, 7), (0, 1), (16, 17)], torch.float32, None),
}


@pytest.mark.parametrize("case", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_paged_attention_varlen_matches_reference(case: tuple) -> None:
    block_size, head_dim, num_heads, num_kv_heads, seqs, dtype, max_query_len = case
    b = make_batch(
        seqs, block_size=block_size, head_dim=head_dim, num_heads=num_heads,
        num_kv_heads=num_kv_heads, dtype=dtype,
    )  # fmt: skip
    assert_close(run_varlen(b, max_query_len=max_query_len), reference(b))


# (block_size, head_dim, num_heads, num_kv_heads, context lengths, dtype, num_splits)
DECODE_CASES = {
    "bs16_hd64_mha_auto_splits": (16, 64, 2, 2, [1, 16, 17, 100], torch.float32, None),
    "bs16_hd128_gqa3_one_split": (16, 128, 3, 1, [1, 16, 17, 70], torch.float32, 1),
    "bs32_hd64_gqa8_three_splits": (32, 64, 8, 1, [1, 32, 33, 200], torch.float32, 3),
    # More splits than 64-key tiles: most splits are empty and must weigh nothing in the reduce.
    "bs16_hd64_gqa3_empty_splits": (16, 64, 3, 1, [1, 17, 150], torch.float32, 6),
    "bs32_hd128_gqa8_bf16_splits": (32, 128, 8, 1, [1, 33, 140], torch.bfloat16, 2),
    "bs16_hd64_mha_fp16_splits": (16, 64, 2, 2, [16, 1, 130], torch.float16, 3),
}


@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_paged_decode_attention_matches_reference(case: tuple) -> None:
    block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, num_splits = case
    b = make_batch(
        [(n - 1, 1) for n in context_lens], block_size=block_size, head_dim=head_dim,
        num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype,
    )  # fmt: skip
    out = pa.paged_decode_attention(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale, num_splits=num_splits
    )
    expected = pa.paged_decode_attention_reference(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale
    )
    assert_close(out, expected)


# (block_size, head_dim, num_heads, num_kv_heads, dtype): head dims 48/64/80/128, GQA 1 and 4,
# block sizes 1/16/32, both dtypes.
EXTRAS_SHAPES = {
    "bs1_hd48_mha_fp32": (1, 48, 4, 4, torch.float32),
    "bs16_hd64_gqa4_bf16": (16, 64, 8, 2, torch.bfloat16),
    "bs32_hd80_gqa4_fp32": (32, 80, 4, 1, torch.float32),
    "bs16_hd128_mha_fp32": (16, 128, 2, 2, torch.float32),
    "bs32_hd48_gqa4_bf16": (32, 48, 4, 1, torch.bfloat16),
}
# Shape i takes the i-th of the 5 (window, cap) pairs: every shape and every pair once, at 5
# interpreter runs rather than 25. A window alone meets both dtypes (a window of 1 in fp32 with
# block size 1, block_size + 1 in bf16), the cap both (alone in fp32, with a window in bf16).
EXTRAS_CASES = [
    pytest.param(shape, window, cap, id=f"{name}-window{window}-cap{cap}")
    for i, (name, shape) in enumerate(EXTRAS_SHAPES.items())
    for j, (window, cap) in enumerate(attention_extras_cases(shape[0]))
    if i == j
]


@pytest.mark.parametrize(("shape", "window", "soft_cap"), EXTRAS_CASES)
def test_sliding_window_and_soft_cap(shape: tuple, window: int | None, soft_cap: float | None) -> None:
    block_size, head_dim, num_heads, num_kv_heads, dtype = shape
    dims = dict(block_size=block_size, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads)
    extras = {"sliding_window": window, "logits_soft_cap": soft_cap}
    b = make_batch(varlen_seqs(block_size), dtype=dtype, **dims)
    b.scale *= EXTRAS_SCALE_FACTOR
    got = run_varlen(b, max_query_len=64, **extras)
    expected = pa.paged_attention_reference(*b.varlen_args, **extras)
    assert_close(got, expected)
    if window is not None and window < 100:  # the window cuts some contexts short
        full = pa.paged_attention_reference(*b.varlen_args, logits_soft_cap=soft_cap)
        assert not torch.allclose(got.float(), full.float(), **TOLERANCE[dtype])
    # decode_seqs without its 1000-token context, which costs seconds in the interpreter.
    d = make_batch(
        [(n, 1) for n, _ in decode_seqs(block_size) if n < 500] + [(130, 1)], dtype=dtype, seed=1, **dims
    )
    d.scale *= EXTRAS_SCALE_FACTOR
    # Three splits of the window, some empty when it is short.
    got = pa.paged_decode_attention(*d.decode_args, num_splits=3, **extras)
    assert_close(got, pa.paged_decode_attention_reference(*d.decode_args, **extras))


def test_extras_reject_bad_values() -> None:
    b = make_batch([(3, 1)], block_size=16, head_dim=64, num_heads=2, num_kv_heads=2, dtype=torch.float32)
    for extras in ({"sliding_window": 0}, {"sliding_window": 1.5}, {"logits_soft_cap": -1.0}):
        with pytest.raises(ValueError, match=r"sliding_window|logits_soft_cap"):
            run_varlen(b, **extras)
        with pytest.raises(ValueError, match=r"sliding_window|logits_soft_cap"):
            pa.paged_decode_attention(*b.decode_args, **extras)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_same_through_both_kernels(dtype: torch.dtype) -> None:
    # All query lengths 1: paged_attention dispatches to split-K decode; a max_query_len hint of 2
    # forces the varlen kernel. Both must agree with each other and with the reference.
    b = make_batch(
        [(0, 1), (15, 1), (16, 1), (80, 1)], block_size=16, head_dim=64, num_heads=4, num_kv_heads=2,
        dtype=dtype,
    )  # fmt: skip
    via_decode = run_varlen(b)
    via_varlen = run_varlen(b, max_query_len=2)
    assert_close(via_decode, reference(b))
    assert_close(via_varlen, reference(b))
    torch.testing.assert_close(via_decode.float(), via_varlen.float(), **TOLERANCE[dtype])


def test_out_argument_is_filled_and_returned() -> None:
    b = make_batch(
        [(5, 7), (0, 3)], block_size=16, head_dim=64, num_heads=2, num_kv_heads=1, dtype=torch.float32
    )
    out = torch.empty_like(b.q)
    assert run_varlen(b, out=out) is out
    assert_close(out, reference(b))
    decode = make_batch(
        [(5, 1)], block_size=16, head_dim=64, num_heads=2, num_kv_heads=1, dtype=torch.float32
    )
    out = torch.empty_like(decode.q)
    result = pa.paged_decode_attention(
        decode.q, decode.k_cache, decode.v_cache, decode.block_tables, decode.seq_lens, decode.scale, out
    )
    assert result is out
    assert_close(out, reference(decode))


def test_strided_q_and_out_views() -> None:
    # q as a slice of a fused qkv projection output: rows are not contiguous.
    b = make_batch(
        [(3, 7), (20, 1)], block_size=16, head_dim=64, num_heads=2, num_kv_heads=2, dtype=torch.float32
    )
    qkv = torch.randn((b.q.shape[0], 6, 64), device=DEVICE)
    qkv[:, :2] = b.q
    b.q = qkv[:, :2]
    out_buffer = torch.zeros((b.q.shape[0], 4, 64), device=DEVICE)
    out = run_varlen(b, out=out_buffer[:, 1:3])
    assert_close(out, reference(b))
    assert (out_buffer[:, 0] == 0).all() and (out_buffer[:, 3] == 0).all()


def test_empty_batch_returns_empty_out() -> None:
    b = make_batch([(3, 1)], block_size=16, head_dim=64, num_heads=2, num_kv_heads=2, dtype=torch.float32)
    q = b.q[:0]
    qsl = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = pa.paged_attention(q, b.k_cache, b.v_cache, b.block_tables[:0], qsl, b.seq_lens[:0], b.scale)
    assert out.shape == q.shape


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=4),
    gqa=st.sampled_from([(2, 2), (3, 1), (8, 1)]),
    block_size=st.sampled_from([16, 32]),
)
def test_varlen_property_random_batches(
    seqs: list[tuple[int, int]], gqa: tuple[int, int], block_size: int
) -> None:
    b = make_batch(
        seqs, block_size=block_size, head_dim=64, num_heads=gqa[0], num_kv_heads=gqa[1], dtype=torch.float32
    )
    assert_close(run_varlen(b), reference(b))


def test_choose_decode_num_splits() -> None:
    cpu = torch.device("cpu")
    # One long sequence gets several splits; a big batch already fills the machine.
    assert pa.choose_decode_num_splits(1, 1, 8192, cpu) > 1
    assert pa.choose_decode_num_splits(256, 8, 8192, cpu) == 1
    # Short contexts are never split below _MIN_TOKENS_PER_SPLIT tokens.
    assert pa.choose_decode_num_splits(1, 1, 100, cpu) == 1
    assert 1 <= pa.choose_decode_num_splits(1, 1, 10**9, cpu) <= pa._MAX_SPLITS


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "context", "num_sms", "fill", "wave"),
    [
        # The H200 (132 SMs), 8 KV heads: batch 1 x 2048, sweep best 32 ("fill" takes 8)
        (1, 8, 2048, 132, 8, 32),
        # batch 16 x 2048, sweep best 4 ("fill" takes 3)
        (16, 8, 2048, 132, 3, 4),
        # a grid of a wave or more: no split in either policy
        (64, 8, 2048, 132, 1, 1),
        (256, 8, 8192, 132, 1, 1),
        # short contexts: splits of one 64-key tile at most
        (1, 8, 128, 132, 1, 2),
        # a smaller GPU (the SM count is an input): 1 x 2048 on 16 SMs
        (1, 8, 2048, 16, 4, 4),
        # the cap
        (1, 1, 10**6, 132, 64, 64),
    ],
)
def test_decode_num_splits_policies(
    num_seqs: int, num_kv_heads: int, context: int, num_sms: int, fill: int, wave: int
) -> None:
    assert pa.decode_num_splits(num_seqs, num_kv_heads, context, num_sms, "fill") == fill
    assert pa.decode_num_splits(num_seqs, num_kv_heads, context, num_sms, "wave") == wave


def test_decode_split_policy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")  # 4 "SMs" off the GPU
    assert pa.choose_decode_num_splits(1, 2, 2048, cpu) == 4
    monkeypatch.setenv(pa.SPLIT_POLICY_ENV, "wave")
    assert pa.choose_decode_num_splits(1, 2, 2048, cpu) == 4
    assert pa.choose_decode_num_splits(1, 1, 2048, cpu) == 8
    monkeypatch.setenv(pa.SPLIT_POLICY_ENV, "fastest")
    with pytest.raises(ValueError, match="QWORKER_DECODE_SPLITS"):
        pa.choose_decode_num_splits(1, 1, 2048, cpu)


def _bad_inputs() -> dict[str, tuple[dict, str]]:
    # Each entry: the keyword overrides for paged_attention and the expected message fragment.
    b = make_batch(
        [(3, 2), (0, 1)], block_size=16, head_dim=64, num_heads=4, num_kv_heads=2, dtype=torch.float32
    )
    good = dict(
        q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, block_tables=b.block_tables,
        query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, scale=b.scale,
    )  # fmt: skip
    wide = torch.zeros((*b.k_cache.shape[:3], 128), device=DEVICE)
    return {
        "q_2d": ({**good, "q": b.q[:, 0]}, "q must be 3-D"),
        "q_int": ({**good, "q": b.q.to(torch.int32)}, "dtype"),
        "cache_dtype": ({**good, "k_cache": b.k_cache.half(), "v_cache": b.v_cache.half()}, "dtypes differ"),
        "cache_3d": ({**good, "k_cache": b.k_cache[0], "v_cache": b.v_cache[0]}, "k_cache must be 4-D"),
        "cache_shapes_differ": ({**good, "v_cache": b.v_cache[:1]}, "v_cache shape"),
        "cache_head_dim_strided": ({**good, "k_cache": wide[..., ::2], "v_cache": wide[..., ::2]}, "stride"),
        "q_head_dim_strided": ({**good, "q": torch.zeros((3, 4, 128), device=DEVICE)[..., ::2]}, "stride"),
        "gqa_not_multiple": ({**good, "q": torch.zeros((3, 3, 64), device=DEVICE)}, "multiple"),
        "block_tables_int64": ({**good, "block_tables": b.block_tables.long()}, "int32"),
        "block_tables_rows": ({**good, "block_tables": b.block_tables[:1]}, "block_tables"),
        "query_start_loc_int64": ({**good, "query_start_loc": b.query_start_loc.long()}, "int32"),
        "query_start_loc_2d": ({**good, "query_start_loc": b.query_start_loc[None]}, "query_start_loc"),
        "seq_lens_length": ({**good, "seq_lens": b.seq_lens[:1]}, "seq_lens"),
        "seq_lens_int64": ({**good, "seq_lens": b.seq_lens.long()}, "int32"),
        "scale_negative": ({**good, "scale": -1.0}, "scale"),
        "out_dtype": ({**good, "out": torch.empty_like(b.q, dtype=torch.float16)}, "out must match q"),
        "out_shape": ({**good, "out": torch.empty_like(b.q[:1])}, "out must match q"),
    }


BAD_INPUT_IDS = list(_bad_inputs())


@pytest.mark.parametrize("name", BAD_INPUT_IDS)
def test_paged_attention_rejects_bad_input(name: str) -> None:
    kwargs, message = _bad_inputs()[name]
    with pytest.raises(ValueError, match=message):
        pa.paged_attention(**kwargs)


def test_paged_decode_attention_rejects_bad_input() -> None:
    b = make_batch(
        [(3, 1), (0, 1)], block_size=16, head_dim=64, num_heads=4, num_kv_heads=2, dtype=torch.float32
    )
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    with pytest.raises(ValueError, match="num_splits"):
        pa.paged_decode_attention(*args, num_splits=0)
    with pytest.raises(ValueError, match="seq_lens"):
        pa.paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens[:1], b.scale)
    with pytest.raises(ValueError, match="block_tables"):
        pa.paged_decode_attention(b.q[:1], b.k_cache, b.v_cache, b.block_tables, b.seq_lens[:1], b.scale)


BF16_POINTERS = {
    "out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
    "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
    "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
}  # fmt: skip


def test_kernels_compile_for_sm90_without_spills(compile_for_sm90) -> None:
    # The bf16 GPU path (tensor-core tl.dot) is what the interpreter cannot run; at least compile it
    # for an H100/H200 with the launchers' settings and check for MMA and register spills.
    common = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, TILE_N=64, DOT_MODE=DOT_NATIVE)
    specs = [
        dict(kernel="_paged_attention_varlen_kernel", num_warps=4,
             constexprs=dict(common, NUM_QUERIES_PER_KV=4, BLOCK_M=16, BLOCK_Q=4)),
        dict(kernel="_paged_attention_varlen_kernel", num_warps=8,
             constexprs=dict(common, NUM_QUERIES_PER_KV=1, BLOCK_M=64, BLOCK_Q=64)),
        dict(kernel="_paged_decode_attention_kernel", num_warps=4,
             constexprs=dict(common, NUM_HEADS=32, NUM_QUERIES_PER_KV=4, GROUP_PAD=16, NUM_SPLITS=8)),
        dict(kernel="_paged_decode_reduce_kernel", num_warps=4,
             constexprs=dict(NUM_HEADS=32, HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=8, SPLITS_PAD=8)),
        # Triton specializes int arguments equal to 1 as constants: a batch of one sequence.
        dict(kernel="_paged_attention_varlen_kernel", num_warps=4,
             constexprs=dict(common, num_seqs=1, stride_bt=1, NUM_QUERIES_PER_KV=4, BLOCK_M=16, BLOCK_Q=4)),
    ]  # fmt: skip
    # Windowed and soft-capped layers: the same kernels with both switches on.
    extras = dict(USE_WINDOW=True, USE_SOFT_CAP=True)
    specs += [
        dict(kernel="_paged_attention_varlen_kernel", num_warps=8,
             constexprs=dict(common, **extras, NUM_QUERIES_PER_KV=1, BLOCK_M=64, BLOCK_Q=64)),
        dict(kernel="_paged_decode_attention_kernel", num_warps=4,
             constexprs=dict(common, **extras, NUM_HEADS=32, NUM_QUERIES_PER_KV=4, GROUP_PAD=16,
                             NUM_SPLITS=8)),
    ]  # fmt: skip
    for spec in specs:
        if spec["kernel"] != "_paged_decode_reduce_kernel":  # the merge knows no extras
            spec["constexprs"] = {"USE_WINDOW": False, "USE_SOFT_CAP": False, **spec["constexprs"]}
        spec.update(pointer_types=BF16_POINTERS, float_args=["scale_log2", "cap_scale", "cap_log2"])
    # fp32 caches take the exact (input_precision="ieee") dot; odd head_dim and GQA group.
    fp32_pointers = {name: "*fp32" if "bf16" in t else t for name, t in BF16_POINTERS.items()}
    specs.append(
        dict(kernel="_paged_decode_attention_kernel", num_warps=4, pointer_types=fp32_pointers,
             float_args=["scale_log2", "cap_scale", "cap_log2"],
             constexprs=dict(NUM_HEADS=6, HEAD_DIM=80, HEAD_DIM_PAD=128, BLOCK_SIZE=32, TILE_N=64,
                             DOT_MODE=DOT_FP32_IEEE, NUM_QUERIES_PER_KV=3, GROUP_PAD=16, NUM_SPLITS=3,
                             USE_WINDOW=True, USE_SOFT_CAP=False))
    )  # fmt: skip
    results = compile_for_sm90("triton_paged_attention", specs)
    for spec, result in zip(specs, results, strict=True):
        if spec["constexprs"].get("DOT_MODE") == DOT_NATIVE:
            assert result["ptx_has_mma"], f"tl.dot did not lower to tensor-core MMA: {spec}"
        assert result["stack_bytes"] in (None, 0), f"register spills in {spec['kernel']}: {result}"
