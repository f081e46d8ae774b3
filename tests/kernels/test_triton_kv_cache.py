# TRITON_INTERPRET is set by conftest.py (on machines without a GPU) before this imports a kernel.
import pytest
import qworker_kernels.triton_kv_cache as kv
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.timeout(60)


def make_caches(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, device=DEVICE).to(dtype), torch.randn(shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "num_kv_heads", "head_dim", "dtype"),
    [
        (1, 16, 1, 64, torch.float32),
        (7, 16, 2, 128, torch.float32),
        (40, 32, 8, 64, torch.bfloat16),
        (33, 16, 3, 80, torch.float16),  # odd head count and head_dim: padded, masked tiles
    ],
)
@pytest.mark.parametrize("variant", kv.KV_WRITE_VARIANTS)
def test_write_kv_cache_matches_reference(
    num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, variant: str
) -> None:
    num_blocks = 6
    gen = torch.Generator().manual_seed(num_tokens)
    # Distinct slots in random blocks and offsets, including the first and last slot of the cache.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[0] = num_blocks * block_size - 1
    slot_mapping = slots.to(torch.int64).to(DEVICE)
    k = torch.randn((num_tokens, num_kv_heads, head_dim), device=DEVICE).to(dtype)
    v = torch.randn((num_tokens, num_kv_heads, head_dim), device=DEVICE).to(dtype)
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    kv.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, variant=variant)
    kv.write_kv_cache_reference(k, v, k_expected, v_expected, slot_mapping)
    # A copy: bit-exact, and every untouched slot keeps its old value.
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("variant", kv.KV_WRITE_VARIANTS)
def test_write_kv_cache_strided_views(variant: str) -> None:
    # k and v as slices of a fused qkv output; caches as views of one [2, ...] allocation.
    num_tokens, num_kv_heads, head_dim, block_size = 5, 2, 64, 16
    qkv = torch.randn((num_tokens, 4 + 2 * num_kv_heads, head_dim), device=DEVICE)
    k, v = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    kv_caches = torch.zeros((2, 3, block_size, num_kv_heads, head_dim), device=DEVICE)
    k_cache, v_cache = kv_caches[0], kv_caches[1]
    slot_mapping = torch.tensor([0, 17, 18, 47, 5], dtype=torch.int64, device=DEVICE)
    expected = kv_caches.clone()
    kv.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, variant=variant)
    kv.write_kv_cache_reference(k, v, expected[0], expected[1], slot_mapping)
    assert torch.equal(kv_caches, expected)


def test_write_kv_cache_no_tokens_is_a_no_op() -> None:
    k_cache, v_cache = make_caches(2, 16, 2, 64, torch.float32)
    before = k_cache.clone()
    empty = torch.empty((0, 2, 64), device=DEVICE)
    kv.write_kv_cache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before)


def _bad_inputs() -> dict[str, tuple[tuple, str]]:
    k = torch.randn((3, 2, 64), device=DEVICE)
    k_cache, v_cache = make_caches(2, 16, 2, 64, torch.float32)
    slots = torch.tensor([0, 1, 2], dtype=torch.int64, device=DEVICE)
    wide = torch.zeros((3, 2, 128), device=DEVICE)
    return {
        "k_2d": ((k[:, 0], k[:, 0], k_cache, v_cache, slots), "k and v must both be"),
        "v_shape": ((k, k[:2], k_cache, v_cache, slots), "k and v must both be"),
        "cache_3d": ((k, k, k_cache[0], v_cache[0], slots), "k_cache and v_cache must both be"),
        "head_mismatch": ((k[:, :1], k[:, :1], k_cache, v_cache, slots), "num_kv_heads, head_dim"),
        "dtype_mismatch": ((k.half(), k.half(), k_cache, v_cache, slots), "dtypes differ"),
        "int_dtype": ((k.int(), k.int(), k_cache.int(), v_cache.int(), slots), "dtype must be one of"),
        "slots_int32": ((k, k, k_cache, v_cache, slots.int()), "int64"),
        "slots_length": ((k, k, k_cache, v_cache, slots[:2]), "slot_mapping must be"),
        "k_strided_head_dim": ((wide[..., ::2], k, k_cache, v_cache, slots), "stride"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_write_kv_cache_rejects_bad_input(name: str) -> None:
    args, message = _bad_inputs()[name]
    with pytest.raises(ValueError, match=message):
        kv.write_kv_cache(*args)


def test_kernel_compiles_for_sm90(compile_for_sm90) -> None:
    pointers = {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
        "slot_mapping_ptr": "*i64",
    }  # fmt: skip
    shape = dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_DIM_PAD=128)
    results = compile_for_sm90(
        "triton_kv_cache",
        [dict(kernel="_write_kv_cache_kernel", pointer_types=pointers,
              constexprs=dict(shape, SPLIT_KV=False)),
         # the token_kv variant at the 1B model's layer shape, with the warps it launches with
         dict(kernel="_write_kv_cache_kernel", pointer_types=pointers,
              constexprs=dict(NUM_KV_HEADS=8, HEAD_DIM=64, HEADS_PAD=8, HEAD_DIM_PAD=64, SPLIT_KV=True),
              num_warps=kv.kv_write_num_warps(8, 64))],
    )  # fmt: skip
    assert len(results) == 2
    for result in results:
        assert result["stack_bytes"] in (None, 0), result


def test_write_kv_cache_variant_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    k_cache, v_cache = make_caches(2, 16, 2, 64, torch.float32)
    k = torch.randn((3, 2, 64), device=DEVICE)
    slots = torch.tensor([0, 17, 5], dtype=torch.int64, device=DEVICE)
    monkeypatch.setenv(kv.KV_WRITE_ENV, "token_kv")
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv.write_kv_cache(k, -k, k_cache, v_cache, slots)
    kv.write_kv_cache_reference(k, -k, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    monkeypatch.setenv(kv.KV_WRITE_ENV, "per_block")
    with pytest.raises(ValueError, match="token_kv"):
        kv.write_kv_cache(k, k, k_cache, v_cache, slots)


def test_kv_write_num_warps() -> None:
    # 8 heads x 64 (the 1B model): 512 elements, 2 warps of 32 threads x 8; tiny tiles get 1, big 4.
    assert kv.kv_write_num_warps(8, 64) == 2
    assert kv.kv_write_num_warps(1, 64) == 1
    assert kv.kv_write_num_warps(8, 128) == 4
    assert kv.kv_write_num_warps(32, 128) == 4
