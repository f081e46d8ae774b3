"""Paged prefill attention on the CPU: a C kernel (cpu_prefill_attention.c, built at first use by
cpu_build.py), its launcher, and a reference.

Every prefill chunk of a step in one call: each chunk's queries attend causally to their sequence's
whole context, read in place through the block table (the chunk's own K/V must be in the cache
already). A chunk that continues a prompt, or starts after a prefix-cache hit, needs no gathered
copy of its context.

bf16 takes AMX tiles where the kernel was built for an AMX CPU and Linux grants the process the
tile state (`amx_available()`; head_dim a multiple of 32), else AVX512-BF16 dot products where the
CPU has them, else fp32.
"""

from __future__ import annotations

import ctypes
import math

import torch
from qworker_kernels.constants import check_attention_extras
from qworker_kernels.cpu_build import CKernelLibrary

__all__ = ["amx_available", "is_available", "paged_prefill_attention", "paged_prefill_attention_reference"]

_DTYPES = (torch.float32, torch.bfloat16)
_MAX_HEAD_DIM = 256
_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_LIBRARY = CKernelLibrary(
    "cpu_prefill_attention.c",
    {
        # pointers, sizes, scale, window, has_soft_cap, soft_cap, is_bf16, num_threads, allow_amx
        "qw_paged_prefill_attention": [*[_P] * 7, *[_I64] * 8, _F, _I64, _I, _F, _I, _I, _I],
        "qw_prefill_amx_available": [],
    },
    errors={
        1: (ValueError, "a chunk is empty, longer than its context, or its context exceeds its block table"),
        2: (ValueError, "block_tables holds a block id outside [0, num_blocks) within a sequence's length"),
        3: (RuntimeError, "shape the C kernel does not support got past the launcher's checks"),
        4: (MemoryError, "the C kernel could not allocate its working memory"),
    },
)


def is_available() -> bool:
    """True when the C kernel is built (or can be built now) and loaded."""
    return _LIBRARY.is_available()


def amx_available() -> bool:
    """True when bf16 calls with head_dim a multiple of 32 take the AMX tile path: the kernel was
    built for a CPU with AMX-BF16 and the process was granted the tile state (asked once)."""
    lib = _LIBRARY.get()
    return lib is not None and lib.qw_prefill_amx_available() == 1


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C kernel takes these shapes and dtypes (else use a torch path)."""
    head_dim = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype == q.dtype
        and head_dim % 16 == 0
        and head_dim <= _MAX_HEAD_DIM
        and is_available()
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_begin: int,
    seq_end: int,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    allow_amx: bool = True,
) -> torch.Tensor:
    """Causal attention for sequences [seq_begin, seq_end) of a step's batch.

    q, out: [num_tokens, num_heads, head_dim] (the whole step's tokens; sequence s owns rows
    query_start_loc[s] to query_start_loc[s + 1], the last positions of its context). k_cache,
    v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype (fp32 or bf16).
    block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (context length,
    the chunk included); query_start_loc: [num_seqs + 1] int32. With `sliding_window` W the query
    at position i sees keys j with i - W < j <= i only (key blocks before a tile's windows are
    neither converted nor read); with `logits_soft_cap` c the scaled scores s become
    tanh(s / c) * c before the softmax. `allow_amx=False` keeps bf16 off the AMX path (benchmarks
    and tests compare the paths). Writes the sequences' rows of `out` and returns it. Raises
    ValueError on bad inputs.
    """
    check_attention_extras(sliding_window, logits_soft_cap)
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": out}
    tensors.update(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    if q.dim() != 3 or out.shape != q.shape or out.dtype != q.dtype or q.dtype not in _DTYPES:
        raise ValueError(
            f"q and out must be [tokens, heads, head_dim] fp32/bf16, got {tuple(q.shape)} {q.dtype}"
        )
    if (
        k_cache.dim() != 4
        or v_cache.shape != k_cache.shape
        or k_cache.dtype != q.dtype
        or v_cache.dtype != q.dtype
    ):
        raise ValueError(f"k_cache/v_cache must be [blocks, block_size, kv_heads, head_dim] {q.dtype}")
    num_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)}")
    if head_dim % 16 or head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 16 up to {_MAX_HEAD_DIM}, got {head_dim}")
    num_seqs = seq_lens.shape[0]
    for name, t, rows in (
        ("block_tables", block_tables, num_seqs),
        ("query_start_loc", query_start_loc, None),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if rows is not None and t.shape[0] != rows:
            raise ValueError(f"{name} must have {rows} rows")
    if seq_lens.dtype != torch.int32 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError("seq_lens must be int32 [num_seqs] and query_start_loc int32 [num_seqs + 1]")
    if not 0 <= seq_begin <= seq_end <= num_seqs:
        raise ValueError(f"sequence range [{seq_begin}, {seq_end}) outside [0, {num_seqs}]")
    rc = _LIBRARY.require().qw_paged_prefill_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        query_start_loc.data_ptr(), out.data_ptr(), seq_begin, seq_end, num_heads, num_kv_heads, head_dim,
        block_size, block_tables.shape[1], num_blocks, float(scale),
        # No window is a window as long as the longest context the tables can hold.
        max(1, block_tables.shape[1] * block_size) if sliding_window is None else sliding_window,
        int(logits_soft_cap is not None), 0.0 if logits_soft_cap is None else float(logits_soft_cap),
        int(q.dtype == torch.bfloat16), torch.get_num_threads(), int(allow_amx),
    )  # fmt: skip
    _LIBRARY.check("paged_prefill_attention", rc)
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_begin: int,
    seq_end: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Obviously-correct reference for tests: float64, one sequence and head at a time, with the
    window and cap of `paged_prefill_attention`. Returns the rows of sequences [seq_begin, seq_end)
    (others zero)."""
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for s in range(seq_begin, seq_end):
        start, end, length = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(seq_lens[s])
        blocks = block_tables[s, : math.ceil(length / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].double()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].double()
        positions = torch.arange(length - (end - start), length)
        visible = torch.arange(length)[None, :] <= positions[:, None]  # [n, length]
        if sliding_window is not None:
            visible &= positions[:, None] - torch.arange(length)[None, :] < sliding_window
        for h in range(num_heads):
            scores = q[start:end, h].double() @ k[:, h // group].T * scale
            if logits_soft_cap is not None:
                scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start:end, h] = (probs @ v[:, h // group]).to(q.dtype)
    return out
