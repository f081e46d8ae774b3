"""Write the new tokens' K and V into the paged KV cache by slot mapping.

k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; token t goes to
slot_mapping[t] = block_id * block_size + offset_in_block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from qworker_kernels import envs
from qworker_kernels.constants import FLOAT_DTYPES


@triton.jit
def _copy_token(src_ptr, stride_src_h, dst_ptr, stride_dst_h, offs_h, offs_d, mask):
    # One token's [HEADS_PAD, HEAD_DIM_PAD] tile, heads strided, head_dim contiguous on both sides.
    x = tl.load(src_ptr + offs_h[:, None] * stride_src_h + offs_d[None, :], mask=mask)
    tl.store(dst_ptr + offs_h[:, None] * stride_dst_h + offs_d[None, :], x, mask=mask)


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLIT_KV: tl.constexpr,
):
    # One program per token, all its heads at once, [HEADS_PAD, HEAD_DIM_PAD]: grid (num_tokens,),
    # the program writes K and V; with SPLIT_KV grid (num_tokens, 2), program (t, 0) writes K and
    # (t, 1) V: twice the programs, each half the bytes (decode batches leave most SMs idle otherwise).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block_id = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    is_k = True
    is_v = True
    if SPLIT_KV:
        is_k = tl.program_id(1) == 0
        is_v = tl.program_id(1) == 1
    if is_k:
        _copy_token(
            k_ptr + token * stride_kt,
            stride_kh,
            k_cache_ptr + block_id * stride_kcb + offset * stride_kcs,
            stride_kch,
            offs_h,
            offs_d,
            mask,
        )
    if is_v:
        _copy_token(
            v_ptr + token * stride_vt,
            stride_vh,
            v_cache_ptr + block_id * stride_vcb + offset * stride_vcs,
            stride_vch,
            offs_h,
            offs_d,
            mask,
        )


# QWORKER_KV_WRITE: the launch shape. "token" (the default): one program per token writing its K
# and V, 4 warps. "token_kv": one program per token and per K or V, with warps sized to the tile
# (8 elements, 16 bytes of bf16, per thread). A candidate until a GPU run A/Bs it: the H200 run
# measured "token" at 27-57% of copy bandwidth.
KV_WRITE_ENV = envs.QWORKER_KV_WRITE.name
KV_WRITE_VARIANTS = ("token", "token_kv")
DEFAULT_KV_WRITE = "token"


def kv_write_num_warps(heads_pad: int, head_dim_pad: int) -> int:
    """Warps for one [heads_pad, head_dim_pad] tile at 8 elements per thread, 1 to 4."""
    return max(1, min(4, heads_pad * head_dim_pad // (8 * 32)))


def _check_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            "k and v must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k's (num_kv_heads, head_dim) {tuple(k.shape[1:])} != the cache's {tuple(k_cache.shape[2:])}"
        )
    if k.dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {k.dtype}")
    if not (v.dtype == k_cache.dtype == v_cache.dtype == k.dtype):
        raise ValueError(
            f"k, v, k_cache, v_cache dtypes differ: {k.dtype}, {v.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1), got {t.stride()}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device}, k is on {k.device}")


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    variant: str | None = None,
) -> None:
    """Store k, v [num_tokens, num_kv_heads, head_dim] into k_cache, v_cache [num_blocks, block_size,
    num_kv_heads, head_dim] at the slots in slot_mapping [num_tokens] int64 (block_id * block_size +
    offset). Slots must be in range and distinct; they are not checked (that would need a device sync).
    `variant`: a KV_WRITE_VARIANTS launch shape; None reads QWORKER_KV_WRITE (default "token").
    """
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    variant = variant or envs.QWORKER_KV_WRITE.get() or DEFAULT_KV_WRITE
    if variant not in KV_WRITE_VARIANTS:
        raise ValueError(f"{KV_WRITE_ENV} / variant must be one of {KV_WRITE_VARIANTS}, got {variant!r}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    heads_pad, head_dim_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    is_split = variant == "token_kv"
    _write_kv_cache_kernel[(num_tokens, 2 if is_split else 1)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=heads_pad,
        HEAD_DIM_PAD=head_dim_pad,
        SPLIT_KV=is_split,
        num_warps=kv_write_num_warps(heads_pad, head_dim_pad) if is_split else 4,
    )  # fmt: skip


def write_kv_cache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch `write_kv_cache`."""
    block_size = k_cache.shape[1]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[block_ids, offsets] = k
    v_cache[block_ids, offsets] = v
