"""Batch-invariant paged attention for the CPU (cpu_invariant_attention.c, built at first use): one
kernel for prefill chunks and decode steps whose reduction over a token's keys is fixed by the
token's absolute position (16-key tiles aligned to positions 0, 16, 32, ...), so a token's output
is the same bits alone or in a batch, in any prefill chunk, in a decode step, after a prefix-cache
hit or a recompute after preemption. K and V are read from the cache only.

bf16 runs on AMX tiles (32-key tiles, TDPBF16PS for Q K^T and P V) where the CPU, the build and
the OS allow it, else on VDPBF16PS (16-key tiles) with AVX512-BF16, else fp32 FMAs; each path is
invariant on its own, and they give different bits from each other.

`paged_attention_reference` is the same attention in float64 (what the kernel approximates).
"""

from __future__ import annotations

import ctypes
import math

import torch
from qworker_kernels import envs
from qworker_kernels.cpu_build import CKernelLibrary

__all__ = ["is_available", "paged_attention", "paged_attention_reference", "supports", "token_positions"]

_DTYPES = (torch.float32, torch.bfloat16)
_MAX_HEAD_DIM = 256
_MAX_GROUP = 16
_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_LIBRARY = CKernelLibrary(
    "cpu_invariant_attention.c",
    {"qw_inv_paged_attention": [_P, _I64, *[_P] * 6, *[_I64] * 8, _F, _I64, _I, _F, _I, _I, _I]},
    errors={
        1: (ValueError, "a token position is outside its block table"),
        2: (ValueError, "block_tables holds a block id outside [0, num_blocks) below a token's position"),
        3: (
            ValueError,
            "head_dim must be a multiple of 16 up to 256, with at most 16 query heads per KV head",
        ),
        4: (MemoryError, "the C kernel could not allocate its working memory"),
    },
    # FMA contraction stays on (GCC's default): it is decided once per expression at compile time,
    # and every token runs the same expressions, so it changes bits between builds, never between
    # batches.
)


def is_available() -> bool:
    return _LIBRARY.is_available()


def amx_allowed() -> bool:
    """False when ``QWORKER_INVARIANT_ATTENTION_AMX=0``: bf16 then takes the VDPBF16PS path even
    where AMX tiles are there (for comparisons; the two paths give different bits)."""
    return envs.QWORKER_INVARIANT_ATTENTION_AMX.get()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """q: [T, H, D], k_cache: [blocks, block_size, KVH, D]: shapes and dtypes the kernel takes."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype == q.dtype
        and head_dim % 16 == 0
        and head_dim <= _MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= _MAX_GROUP
    )


def token_positions(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's sequence row and absolute position, both [T] int32, from seq_lens [S] and
    query_start_loc [S + 1] (the last query_len tokens of each sequence are this step's)."""
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(query_lens), device=seq_lens.device), query_lens)
    token = torch.arange(int(query_start_loc[-1]), device=seq_lens.device)
    pos = seq_lens.long()[seq] - (query_start_loc.long()[seq + 1] - token)
    return seq.to(torch.int32), pos.to(torch.int32)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; caches [blocks, block_size, KVH, D] already holding every token's K/V;
    block_tables [S, max_blocks] int32; token_seq, token_pos: [T] int32 -> out [T, H, D]."""
    if not supports(q, k_cache):
        raise ValueError(
            f"unsupported q {tuple(q.shape)} {q.dtype} / cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous() or t.dtype != q.dtype:
            raise ValueError(f"{name} must be contiguous {q.dtype}")
    tables = block_tables.to(torch.int32).contiguous()
    seq = token_seq.to(torch.int32).contiguous()
    pos = token_pos.to(torch.int32).contiguous()
    if num_tokens == 0:
        return out
    status = _LIBRARY.require().qw_inv_paged_attention(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        seq.data_ptr(), pos.data_ptr(), out.data_ptr(), out.stride(0), num_tokens, num_heads,
        num_kv_heads, head_dim, block_size, tables.shape[1], num_blocks, scale,
        sliding_window or 0, int(logits_soft_cap is not None), logits_soft_cap or 0.0,
        int(q.dtype == torch.bfloat16), int(amx_allowed()), torch.get_num_threads(),
    )  # fmt: skip
    _LIBRARY.check("qw_inv_paged_attention", status)
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """The same attention in float64, one token at a time, rounded to q's dtype."""
    out = torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    for t in range(q.shape[0]):
        pos = int(token_pos[t])
        start = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        positions = torch.arange(start, pos + 1)
        blocks = block_tables[int(token_seq[t])].long()[positions // block_size]
        keys = k_cache[blocks, positions % block_size].double()  # [L, KVH, D]
        values = v_cache[blocks, positions % block_size].double()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), keys) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        probs = scores.softmax(dim=-1)
        out[t] = torch.einsum("hl,lhd->hd", probs, values).to(q.dtype)
    return out


# A scale helper for tests and benches: the usual 1 / sqrt(head_dim).
def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
