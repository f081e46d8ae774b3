from __future__ import annotations

import torch
import torch.nn.functional as F
from qworker_kernels.constants import is_triton_interpreter_enabled
from qworker_kernels.cpu_paged_attention import paged_decode_attention_torch

from qworker import envs
from qworker.errors import InvalidConfigError
from qworker.model.attention_types import AttentionBackend, AttentionMetadata
from qworker.utils import cdiv


def write_kv_cache_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # caches: [num_blocks, block_size, KVH, D] viewed as [num_slots, KVH, D]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttentionBackend:
    """CPU/any-device attention that reads K/V through the block tables.

    On the CPU, compiled kernels (when they build): decodes in one batched call, and every prefill
    chunk of the step in one more, both reading K/V in place. Elsewhere, or without a C compiler,
    decodes gather a few sequences at a time and prefill chunks run one sequence at a time through
    SDPA.
    """

    name = "torch"
    # Prefill reads the host lists and decodes may take the CPU kernel: not capturable.
    supports_cuda_graphs = False

    def __init__(self) -> None:
        self._decode_kernel = _load_cpu_decode_kernel()
        self._prefill_kernel = _load_cpu_prefill_kernel()
        self._kv_writer = _load_cpu_kv_writer()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        head_dim = k_cache.shape[-1]
        if (
            self._kv_writer is not None
            and q.device.type == "cpu"
            and k.stride()[1:] == v.stride()[1:] == (head_dim, 1)
        ):
            self._kv_writer(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv_cache_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        num_decodes = meta.num_decode_seqs
        num_seqs = len(meta.seq_lens_list)
        is_decode_kernel = self._decode_kernel is not None and q.device.type == "cpu"
        is_prefill_kernel = (
            num_seqs > num_decodes
            and self._prefill_kernel is not None
            and self._prefill_kernel.supports(q, k_cache)
        )
        if (sliding_window is not None or logits_soft_cap is not None) and not (
            is_decode_kernel and (num_seqs == num_decodes or is_prefill_kernel)
        ):
            # The C kernels take windows and caps; without them (another device, no compiler, a
            # head_dim they lack) these layers run in plain torch.
            return windowed_attention_torch(
                q, k, v, k_cache, v_cache, meta, scale,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            )  # fmt: skip
        out = torch.empty_like(q)
        if num_decodes:
            decode_q = q[:num_decodes]
            tables = meta.block_tables[:num_decodes]
            lens = meta.seq_lens[:num_decodes]
            if is_decode_kernel:
                self._decode_kernel(
                    decode_q, k_cache, v_cache, tables, lens, scale, out=out[:num_decodes],
                    sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                )  # fmt: skip
            else:
                paged_decode_attention_torch(
                    decode_q, k_cache, v_cache, tables, lens, scale, out=out[:num_decodes]
                )
        if is_prefill_kernel:
            self._prefill_kernel.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                num_decodes, num_seqs, scale, out,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            )  # fmt: skip
            return out
        num_kv_heads, head_dim = k_cache.shape[-2:]
        token_start = num_decodes
        block_size = meta.block_size
        for seq_index in range(num_decodes, len(meta.seq_lens_list)):
            query_len = meta.query_lens_list[seq_index]
            seq_len = meta.seq_lens_list[seq_index]
            token_end = token_start + query_len
            seq_q = q[token_start:token_end]
            if query_len == seq_len:
                # Whole context is in this chunk: use the fresh K/V, no cache read.
                seq_k, seq_v = k[token_start:token_end], v[token_start:token_end]
            else:
                block_ids = torch.tensor(meta.block_ids_list[seq_index], device=q.device)
                num_blocks = cdiv(seq_len, block_size)
                seq_k = k_cache[block_ids[:num_blocks]].view(-1, num_kv_heads, head_dim)[:seq_len]
                seq_v = v_cache[block_ids[:num_blocks]].view(-1, num_kv_heads, head_dim)[:seq_len]
            out[token_start:token_end] = _prefill_attention(seq_q, seq_k, seq_v, scale)
            token_start = token_end
        return out


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    key_start: int = 0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """q: [n, H, D] are the last n positions of a context whose keys from position `key_start` on
    are k/v: [L, KVH, D]; causal, within `sliding_window`, scores capped by `logits_soft_cap`."""
    query_len, num_keys = q.shape[0], k.shape[0]
    context_len = key_start + num_keys
    # [1, heads, len, D]: SDPA's fused CPU kernels take 4-D inputs only; 3-D falls back to the
    # unfused math path, about 12x slower for a 256-token bf16 prompt.
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if query_len == num_keys and key_start == 0 and sliding_window is None and logits_soft_cap is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    key_positions = torch.arange(key_start, context_len, device=q.device)
    query_positions = torch.arange(context_len - query_len, context_len, device=q.device)
    # mask: [n, L], True where the query may see the key.
    mask = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        mask &= query_positions[:, None] - key_positions[None, :] < sliding_window
    if logits_soft_cap is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    # Query head h reads KV head h // group (transformers' repeat_kv): [1, KVH, group * n, D].
    grouped_q = qt.reshape(1, num_kv_heads, group * query_len, q.shape[-1])
    grouped_mask = mask.repeat(group, 1)[None, None]  # [1, 1, group * n, L]
    out = _soft_capped_attention(grouped_q, kt, vt, grouped_mask, scale, logits_soft_cap)
    # [1, KVH, group * n, D] -> [n, H, D]
    return out.reshape(num_heads, query_len, -1).transpose(0, 1)


def _soft_capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float | None
) -> torch.Tensor:
    """q: [B, KVH, M, D] (M query rows per KV head), k/v: [B, KVH, L, D], mask broadcastable to
    [B, KVH, M, L] -> [B, KVH, M, D]. The order of operations is transformers' eager attention."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def windowed_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """Attention for a layer with a sliding window or a logits soft-cap, in plain torch on any
    device, K/V already in the caches: decodes in groups through a gather of their windows,
    prefill chunks one sequence at a time. Keys outside every query's window are never read."""
    out = torch.empty_like(q)
    num_decodes = meta.num_decode_seqs
    if num_decodes:
        _decode_in_window(q[:num_decodes], k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap,
                          out[:num_decodes])  # fmt: skip
    token_start = num_decodes
    for seq_index in range(num_decodes, len(meta.seq_lens_list)):
        query_len = meta.query_lens_list[seq_index]
        seq_len = meta.seq_lens_list[seq_index]
        token_end = token_start + query_len
        # The first query (position seq_len - query_len) sees keys from key_start on.
        key_start = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
        if query_len == seq_len:
            seq_k, seq_v = k[token_start:token_end], v[token_start:token_end]
        else:
            seq_k, seq_v = _gather_context(
                k_cache, v_cache, meta.block_ids_list[seq_index], key_start, seq_len, meta.block_size
            )
        out[token_start:token_end] = _prefill_attention(
            q[token_start:token_end], seq_k, seq_v, scale,
            key_start=key_start, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip
        token_start = token_end
    return out


def _gather_context(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: list[int],
    key_start: int,
    seq_len: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of positions [key_start, seq_len) of one sequence: each [seq_len - key_start, KVH, D]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    first_block = key_start // block_size
    ids = torch.tensor(block_ids[first_block : cdiv(seq_len, block_size)], device=k_cache.device)
    offset = first_block * block_size
    seq_k = k_cache[ids].view(-1, num_kv_heads, head_dim)[key_start - offset : seq_len - offset]
    seq_v = v_cache[ids].view(-1, num_kv_heads, head_dim)[key_start - offset : seq_len - offset]
    return seq_k, seq_v


# Decodes are gathered a few at a time so that the gathered K and V stay near this size.
_DECODE_GATHER_BYTES = 64 * 2**20


def _decode_in_window(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    out: torch.Tensor,
) -> None:
    """q, out: [S, H, D], one query each (the first S sequences of the batch, at position
    seq_len - 1); each reads the last min(seq_len, sliding_window) keys of its sequence."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    seq_lens = meta.seq_lens_list[:num_seqs]
    num_keys = [min(n, sliding_window) if sliding_window is not None else n for n in seq_lens]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    bytes_per_key = 2 * num_kv_heads * head_dim * q.element_size()
    start = 0
    while start < num_seqs:
        stop, longest = start + 1, num_keys[start]
        while stop < num_seqs and (stop + 1 - start) * max(longest, num_keys[stop]) * bytes_per_key <= (
            _DECODE_GATHER_BYTES
        ):
            longest = max(longest, num_keys[stop])
            stop += 1
        counts = torch.tensor(num_keys[start:stop], device=q.device)
        first = torch.tensor(seq_lens[start:stop], device=q.device) - counts
        offsets = torch.arange(longest, device=q.device)
        valid = offsets[None, :] < counts[:, None]  # [g, longest]
        # positions: [g, longest]; padding columns repeat the first key (masked out below).
        positions = first[:, None] + torch.where(valid, offsets[None, :], 0)
        tables = meta.block_tables[start:stop].long()
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        keys = flat_k[slots].permute(0, 2, 1, 3)  # [g, KVH, longest, D]
        values = flat_v[slots].permute(0, 2, 1, 3)
        grouped_q = q[start:stop].view(stop - start, num_kv_heads, group, head_dim)
        mask = valid[:, None, None, :]
        result = _soft_capped_attention(grouped_q, keys, values, mask, scale, logits_soft_cap)
        out[start:stop] = result.reshape(stop - start, num_heads, head_dim)
        start = stop


def _load_cpu_decode_kernel():  # type: ignore[no-untyped-def]
    if envs.QWORKER_DISABLE_CPU_KERNEL.get():
        return None
    try:
        from qworker_kernels import cpu_paged_attention
    except ImportError:
        return None
    if not cpu_paged_attention.is_available():
        return None
    return cpu_paged_attention.paged_decode_attention


def _load_cpu_kv_writer():  # type: ignore[no-untyped-def]
    # The C kernel's one memcpy per row (cpu_paged_attention.write_kv_cache) for index_copy_.
    decode_kernel = _load_cpu_decode_kernel()
    if decode_kernel is None:
        return None
    from qworker_kernels import cpu_paged_attention

    return cpu_paged_attention.write_kv_cache


def _load_cpu_prefill_kernel():  # type: ignore[no-untyped-def]
    if envs.QWORKER_DISABLE_CPU_KERNEL.get():
        return None
    try:
        from qworker_kernels import cpu_prefill_attention
    except ImportError:
        return None
    return cpu_prefill_attention if cpu_prefill_attention.is_available() else None


def select_attention_backend(
    requested: str,
    device: torch.device,
) -> AttentionBackend:
    """An explicit `requested` backend (torch, triton) is used as is. `auto` takes
    $QWORKER_ATTENTION_BACKEND when set, else Triton on CUDA and torch elsewhere.

    Both backends take sliding windows and logit soft-capping in their kernels.
    """
    # The variable only decides `auto`: an explicit option always wins over it (qworker/envs.py).
    choice = requested
    if choice == "auto":
        choice = envs.QWORKER_ATTENTION_BACKEND.get() or "auto"
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    backend: AttentionBackend
    if choice == "torch":
        backend = TorchAttentionBackend()
    elif choice == "triton":
        if device.type != "cuda" and not is_triton_interpreter_enabled():
            raise InvalidConfigError(
                f"attention_backend 'triton' needs a CUDA device; this engine runs on {device.type} "
                "(use torch or auto there; TRITON_INTERPRET=1 runs the kernels interpreted, for tests)"
            )
        from qworker.model.triton_attention import TritonAttentionBackend

        backend = TritonAttentionBackend(device)
    else:
        raise InvalidConfigError(f"unknown attention backend {choice!r}; use auto, torch or triton")
    return backend
