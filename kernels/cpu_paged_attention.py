"""Paged decode attention on the CPU: a small C kernel built at first use, a torch fallback, a reference.

The C source (cpu_paged_attention.c, beside this file) reads K and V in place through the block
table: it never gathers the batch's K/V (gathering K alone measured 4.4 ms per layer at 128
sequences x 400 tokens, more than the layer's matmuls). It is built at first use and cached
(cpu_build.py: ``-O3 -march=native -fopenmp``, about 1 s on a quiet machine).

Threads: the kernel uses ``torch.get_num_threads()`` OpenMP threads, from the pool torch uses.

Sliding windows and soft-capping (per layer, keyword arguments of every function here) are in the
C kernel too: a windowed decode reads only the blocks its window touches, so it costs the window,
not the context.

On CPUs with AVX512-BF16 (the AMX Xeons, the AVX512-BF16 EPYC) the bf16 scores and P.V run
AVX512-BF16 code (``bf16_variant()`` says which the build took); elsewhere the generic vector code,
the same source.

It imports no triton: the engine's torch backend uses it on machines without triton.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from qworker_kernels.constants import FLOAT_DTYPES, check_attention_extras
from qworker_kernels.cpu_build import CKernelLibrary

__all__ = [
    "bf16_variant",
    "is_available",
    "kernel_build",
    "paged_decode_attention",
    "paged_decode_attention_float64_reference",
    "paged_decode_attention_torch",
    "write_kv_cache",
]

_DTYPES = (torch.float32, torch.bfloat16)
# The C kernel's limits (MAX_HEAD_DIM there; rows are read 16 elements at a time). Other head
# dims go to the torch path.
_MAX_HEAD_DIM = 512
# The torch fallback gathers K and V for about this many bytes at a time.
_FALLBACK_BYTES = 64 << 20

_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    # pointers, sizes, scale, window, has_soft_cap, soft_cap, is_bf16, num_threads
    "qw_paged_decode_attention": [*[_P] * 6, *[_I64] * 7, _F, _I64, _I, _F, _I, _I],
    # k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, tokens, slots, row_bytes
    "qw_write_kv_cache": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64],
    "qw_paged_decode_bf16_variant": [],
}
_LIBRARY = CKernelLibrary(
    "cpu_paged_attention.c",
    SIGNATURES,
    errors={
        1: (ValueError, "seq_lens holds a length < 1 or > max_blocks_per_seq * block_size"),
        2: (ValueError, "block_tables holds a block id outside [0, num_blocks) within a sequence's length"),
        3: (RuntimeError, "shape the C kernel does not support got past the launcher's checks"),
        4: (MemoryError, "the C kernel could not allocate its working memory"),
    },
)


def is_available() -> bool:
    """True when the C kernel is built (or can be built now) and loaded."""
    return _LIBRARY.is_available()


def kernel_build(source: Path | None = None, extra_flags: Sequence[str] = ()) -> CKernelLibrary:
    """Another build of the decode kernel, loaded at first use: `source` (default this module's C
    file; headers it includes must sit beside it) with `extra_flags`. Pass it to
    `paged_decode_attention(..., library=...)`: the tests build the generic bf16 code with
    ``-DQW_DECODE_GENERIC``, the benchmark an older source with --compare-source."""
    # Another source gets only the decode entry point: older versions lack the other functions.
    signatures = (
        SIGNATURES
        if source is None
        else {"qw_paged_decode_attention": SIGNATURES["qw_paged_decode_attention"]}
    )
    build = CKernelLibrary("cpu_paged_attention.c", signatures, _LIBRARY.errors, extra_flags)
    if source is not None:
        build.source = Path(source)
    return build


def bf16_variant(library: CKernelLibrary = _LIBRARY) -> str | None:
    """The bf16 code the C kernel was built with on this CPU: "avx512-bf16" (the VDPBF16PS
    path of CPUs with AVX512-BF16) or "generic"; None when the kernel is not available."""
    lib = library.get()
    if lib is None:
        return None
    return "avx512-bf16" if lib.qw_paged_decode_bf16_variant() == 1 else "generic"


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    *,
    is_kernel: bool = True,
) -> None:
    """Shapes, dtypes and layout; the C kernel (is_kernel) also needs CPU tensors in fp32/bf16."""
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    named["seq_lens"] = seq_lens
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if is_kernel and t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    # The torch fallback serves the engine on any device (the torch backend on CUDA, fp16 included).
    dtypes = _DTYPES if is_kernel else FLOAT_DTYPES
    if q.dtype not in dtypes:
        raise ValueError(f"q dtype must be one of {dtypes}, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache dtype ({k_cache.dtype}, {v_cache.dtype}) must match q ({q.dtype})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be 2-D int32, got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be 1-D int32, got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) != head_dim of k_cache ({k_cache.shape[3]})")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
            f"must have num_seqs={num_seqs} rows"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    library: CKernelLibrary | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V cache.

    q: [num_seqs, num_heads, head_dim], float32 or bfloat16. k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim], q's dtype. block_tables: [num_seqs, max_blocks_per_seq]
    int32 (entries past a sequence's blocks are ignored). seq_lens: [num_seqs] int32, tokens in the
    cache for each sequence, the current one included. Query head h reads KV head h // (num_heads //
    num_kv_heads). Accumulates in fp32; returns ``out`` (allocated when None) in q's dtype.
    With `sliding_window` W the query (at position seq_len - 1) sees the last W keys only; with
    `logits_soft_cap` c the scaled scores s become tanh(s / c) * c before the softmax.

    Uses the C kernel (`library`: another build from `kernel_build`, default this module's) when it
    is available and head_dim is a multiple of 16 up to 512; otherwise
    ``paged_decode_attention_torch``. Raises ValueError on bad shapes, dtypes, devices,
    non-contiguous inputs, out-of-range seq_lens or block ids (``out`` may then be partly written).
    """
    library = _LIBRARY if library is None else library
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out)
    check_attention_extras(sliding_window, logits_soft_cap)
    if out is None:
        out = torch.empty_like(q)
    head_dim = q.shape[2]
    lib = library.get() if head_dim % 16 == 0 and head_dim <= _MAX_HEAD_DIM else None
    if lib is None:
        return paged_decode_attention_torch(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_context = block_tables.shape[1] * block_size
    rc = lib.qw_paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        q.shape[0],
        q.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        block_tables.shape[1],
        num_blocks,
        float(scale),
        # No window is a window as long as the longest context the tables can hold.
        max(1, max_context) if sliding_window is None else sliding_window,
        int(logits_soft_cap is not None),
        0.0 if logits_soft_cap is None else float(logits_soft_cap),
        int(q.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    library.check("paged_decode_attention", rc)
    return out


def _check_table_values(k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    num_blocks, block_size = k_cache.shape[:2]
    if seq_lens.numel() == 0:
        return
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
        raise ValueError(f"paged_decode_attention: {_LIBRARY.errors[1][1]}")
    # Only the entries within each sequence's length must be valid.
    num_used = (seq_lens.long() + block_size - 1) // block_size  # [num_seqs]
    positions = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = positions < num_used[:, None]  # [num_seqs, max_blocks]
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"paged_decode_attention: {_LIBRARY.errors[2][1]}")


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Plain-torch fallback with the same contract, on any device and also in fp16: gather + SDPA
    for a few sequences at a time.

    Sequences are taken in groups so that the gathered K and V stay near 64 MiB, whatever the
    batch; SDPA's enable_gqa reads each KV head for its whole group, so K/V are not repeated.
    Soft-capped scores need the unfused math (SDPA has no cap), in fp32.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out, is_kernel=False)
    check_attention_extras(sliding_window, logits_soft_cap)
    _check_table_values(k_cache, block_tables, seq_lens)
    if out is None:
        out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    lens = seq_lens.tolist()
    bytes_per_token = 2 * num_kv_heads * head_dim * q.element_size()
    start = 0
    while start < num_seqs:
        # Grow the group while its padded gather fits the budget (always at least one sequence).
        stop, max_len = start + 1, lens[start]
        while stop < num_seqs:
            longest = max(max_len, lens[stop])
            if (stop + 1 - start) * longest * bytes_per_token > _FALLBACK_BYTES:
                break
            stop, max_len = stop + 1, longest
        num_used = math.ceil(max_len / block_size)
        table = block_tables[start:stop, :num_used].long()  # [g, num_used]
        # Entries past a sequence's own blocks are padding, possibly out of range: read block 0.
        blocks_needed = (seq_lens[start:stop, None] + block_size - 1) // block_size
        table = table.masked_fill(torch.arange(num_used, device=q.device) >= blocks_needed, 0)
        # k, v: [g, num_kv_heads, T, head_dim] with T = num_used * block_size
        k = k_cache[table].flatten(1, 2).transpose(1, 2)
        v = v_cache[table].flatten(1, 2).transpose(1, 2)
        positions = torch.arange(k.shape[2], device=q.device)[None, :]
        valid = positions < seq_lens[start:stop, None]  # [g, T]
        if sliding_window is not None:
            valid &= positions >= seq_lens[start:stop, None] - sliding_window
        if logits_soft_cap is not None:
            out[start:stop] = _soft_capped_decode(q[start:stop], k, v, valid, scale, logits_soft_cap)
            start = stop
            continue
        attn = torch.nn.functional.scaled_dot_product_attention(
            q[start:stop, :, None, :],  # [g, num_heads, 1, head_dim]
            k,
            v,
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[start:stop] = attn.view(stop - start, num_heads, head_dim)
        start = stop
    return out


def _soft_capped_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """q: [g, H, D]; k, v: [g, KVH, T, D]; valid: [g, T] -> [g, H, D], softmax in fp32."""
    g, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    grouped_q = q.view(g, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    scores = torch.matmul(grouped_q, k.float().transpose(-1, -2)) * scale  # [g, KVH, group, T]
    scores = torch.tanh(scores / cap) * cap
    probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    return torch.matmul(probs, v.float()).view(g, num_heads, head_dim).to(q.dtype)


def paged_decode_attention_float64_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Obviously-correct reference for tests: one sequence at a time, in float64, K/V repeated for
    GQA; keys outside the window masked, scores capped as `paged_decode_attention` says."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i, : math.ceil(n / block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].double()  # [n, num_kv_heads, head_dim]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].double()
        k = k.repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        if sliding_window is not None:
            # The query sits at position n - 1 and sees key j iff n - 1 - j < sliding_window.
            outside = torch.arange(n) < n - sliding_window
            scores = scores.masked_fill(outside[None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", probs, v).to(q.dtype)
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, KVH, D] (rows may be strided, heads packed within a row) into the caches
    [num_blocks, block_size, KVH, D] at the flat slots slot_mapping [T] int64: the C kernel's
    version of `qworker.model.attention.write_kv_cache_torch`, one memcpy per row."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    num_tokens = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.device.type != "cpu" or t.dtype != k_cache.dtype or t.dtype not in _DTYPES:
            raise ValueError(f"{name} must be a CPU {k_cache.dtype} tensor, got {t.device} {t.dtype}")
        if tuple(t.shape) != (num_tokens, num_kv_heads, head_dim) or t.stride()[1:] != (head_dim, 1):
            raise ValueError(
                f"{name} must be [{num_tokens}, {num_kv_heads}, {head_dim}] with packed heads, "
                f"got {tuple(t.shape)} {t.stride()}"
            )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (
            t.device.type != "cpu"
            or not t.is_contiguous()
            or t.shape != k_cache.shape
            or t.dtype != k_cache.dtype
        ):
            raise ValueError(f"{name} must be a contiguous CPU tensor shaped like k_cache")
    if (
        slot_mapping.dtype != torch.int64
        or slot_mapping.shape != (num_tokens,)
        or not slot_mapping.is_contiguous()
    ):
        raise ValueError(f"slot_mapping must be contiguous int64 [{num_tokens}], got {slot_mapping.dtype}")
    num_slots = k_cache.numel() // (num_kv_heads * head_dim)
    item = k.element_size()
    rc = _LIBRARY.require().qw_write_kv_cache(
        k.data_ptr(), k.stride(0) * item, v.data_ptr(), v.stride(0) * item, k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens, num_slots, num_kv_heads * head_dim * item,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"write_kv_cache: a slot is outside [0, {num_slots})")
