from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from qworker_kernels.cpu_paged_attention import paged_decode_attention_torch

from qworker.utils import cdiv


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the runner and passed down every layer.

    The batch is ordered decodes first (one query token each), then prefill chunks.
    """

    # [num_tokens] int64: cache slot (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32, padded with block 0 past each seq's blocks.
    block_tables: torch.Tensor
    # [num_seqs] int32: context length including this step's tokens.
    seq_lens: torch.Tensor
    # [num_seqs + 1] int32: cumulative query lengths.
    query_start_loc: torch.Tensor
    num_decode_seqs: int
    # Host copies for the per-sequence prefill path (avoid device syncs).
    seq_lens_list: list[int]
    query_lens_list: list[int]
    block_ids_list: list[list[int]]
    block_size: int
    # Largest query length and context length in the batch, known on the host: the Triton
    # backend picks its kernel (decode or varlen) and its split count from them without a sync.
    max_query_len: int
    max_seq_len: int


class AttentionBackend(Protocol):
    name: str
    # True when a decode step through it can be captured in a CUDA graph: static shapes, no host
    # syncs, and no reads of the metadata's host lists.
    supports_cuda_graphs: bool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]; writes k/v into the caches first."""
        ...


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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = meta.num_decode_seqs
        if num_decodes:
            decode_q = q[:num_decodes]
            tables = meta.block_tables[:num_decodes]
            lens = meta.seq_lens[:num_decodes]
            if self._decode_kernel is not None and q.device.type == "cpu":
                self._decode_kernel(decode_q, k_cache, v_cache, tables, lens, scale, out=out[:num_decodes])
            else:
                paged_decode_attention_torch(
                    decode_q, k_cache, v_cache, tables, lens, scale, out=out[:num_decodes]
                )
        num_seqs = len(meta.seq_lens_list)
        if (
            num_seqs > num_decodes
            and self._prefill_kernel is not None
            and self._prefill_kernel.supports(q, k_cache)
        ):
            self._prefill_kernel.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                num_decodes, num_seqs, scale, out,
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


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, H, D] are the last n positions of a context of k/v: [L, KVH, D]; causal."""
    query_len, context_len = q.shape[0], k.shape[0]
    # [1, heads, len, D]: SDPA's fused CPU kernels take 4-D inputs only; 3-D falls back to the
    # unfused math path, about 12x slower for a 256-token bf16 prompt.
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if query_len == context_len:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        key_positions = torch.arange(context_len, device=q.device)
        query_positions = torch.arange(context_len - query_len, context_len, device=q.device)
        mask = key_positions[None, :] <= query_positions[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _load_cpu_decode_kernel():  # type: ignore[no-untyped-def]
    if os.environ.get("QWORKER_DISABLE_CPU_KERNEL"):
        return None
    try:
        from qworker_kernels import cpu_paged_attention
    except ImportError:
        return None
    if not cpu_paged_attention.is_available():
        return None
    return cpu_paged_attention.paged_decode_attention


def _load_cpu_prefill_kernel():  # type: ignore[no-untyped-def]
    if os.environ.get("QWORKER_DISABLE_CPU_KERNEL"):
        return None
    try:
        from qworker_kernels import cpu_prefill_attention
    except ImportError:
        return None
    return cpu_prefill_attention if cpu_prefill_attention.is_available() else None


def select_attention_backend(requested: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA and torch elsewhere; QWORKER_ATTENTION_BACKEND overrides."""
    choice = os.environ.get("QWORKER_ATTENTION_BACKEND", requested) or "auto"
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "torch":
        return TorchAttentionBackend()
    if choice == "triton":
        from qworker.model.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {choice!r}; use auto, torch or triton")
