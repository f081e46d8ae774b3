"""Attention on the Triton kernels of `qworker_kernels`: one KV-cache write and one paged-attention
launch per layer for the whole varlen batch (decode rows and prefill chunks together).

Runs on CUDA, and on CPU under TRITON_INTERPRET=1 (tests). Nothing here syncs with the device, so
a decode step through this backend can be captured in a CUDA graph (qworker.engine.cuda_graphs).
"""

from __future__ import annotations

from typing import Protocol

import torch
from qworker_kernels.constants import is_triton_interpreter_enabled

from qworker.model.attention_types import AttentionMetadata


class PagedAttentionLauncher(Protocol):
    """What the backend launches: `qworker_kernels.triton_paged_attention.paged_attention`, or a
    kernel called the same way (`triton_invariant_attention.invariant_paged_attention`)."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        *,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor: ...


class TritonAttentionBackend:
    """The step's K/V written into the cache, then every token through `attention` (None: the
    default `paged_attention`, whose pure-decode batches take the split-K decode kernel)."""

    name = "triton"

    def __init__(
        self,
        device: torch.device | None = None,
        attention: PagedAttentionLauncher | None = None,
        *,
        supports_cuda_graphs: bool = True,
    ) -> None:
        if device is not None and device.type != "cuda" and not is_triton_interpreter_enabled():
            raise ValueError(
                f"the Triton attention backend runs on CUDA, or on the CPU under TRITON_INTERPRET=1 "
                f"(set before triton is imported); the device is {device}"
            )
        # Imported on first use, not at module load: triton reads TRITON_INTERPRET when the
        # kernels are decorated.
        from qworker_kernels.triton_kv_cache import write_kv_cache

        if attention is None:
            from qworker_kernels.triton_paged_attention import paged_attention

            attention = paged_attention
        self._write_kv_cache = write_kv_cache
        self.attention = attention
        # Static shapes and no host syncs: the runner may capture decode steps in CUDA graphs
        # (unless the model's other layers cannot be captured).
        self.supports_cuda_graphs = supports_cuda_graphs

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
        """q: [T, H, D], k/v: [T, KVH, D] (strided views of the fused qkv are fine) -> [T, H, D]."""
        self._write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        # A fresh contiguous output: q is usually a strided view into the qkv projection.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self.attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            out,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
