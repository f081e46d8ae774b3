from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the KV cache, in blocks and token slots."""

    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    # Tokens whose KV is stored or reserved for this step.
    num_tokens_stored: int
    # Slots in used blocks that hold no token: only the tail of each request's last block.
    num_empty_slots: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0


class BlockPool:
    """Fixed-size KV blocks: a free list and an owner count per block.

    Blocks are ids into the per-layer cache tensors of shape
    [num_blocks, block_size, num_kv_heads, head_dim]; the pool never touches the tensors.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        assert 0 <= num_blocks <= self.num_free_blocks, (
            f"asked for {num_blocks} blocks with {self.num_free_blocks} free"
        )
        block_ids = [self._free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._is_free[block_id] = False
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert not self._is_free[block_id], f"block {block_id} freed twice"
            self._is_free[block_id] = True
            self._free_block_ids.append(block_id)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]
