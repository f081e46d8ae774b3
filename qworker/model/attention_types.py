"""The types every attention backend shares: the per-step metadata the runner builds, and the
backend protocol. They live below attention.py (the torch backend and the backend choice) and
triton_attention.py (the Triton backend), which both import them, so neither imports the other
at module load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
    # [num_seqs] int32: each sequence's whole length known at this step (prompt, and output so
    # far), past seq_lens for a prefill chunk short of the prompt's end. Longrope picks its
    # factors from it; None reads seq_lens (the runner fills it only for such models).
    request_lens: torch.Tensor | None = None


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
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> [T, H, D]; writes k/v into the caches first.

        `sliding_window` W: the query at position i sees key j iff j <= i and i - j < W
        (transformers' `kv_idx > q_idx - sliding_window`). `logits_soft_cap` c: the scaled
        scores s become tanh(s / c) * c before the softmax (Gemma 2).
        """
        ...
