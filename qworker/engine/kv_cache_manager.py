from __future__ import annotations

from qworker.engine.block_pool import BlockPool, KVCacheStats
from qworker.engine.request import Request
from qworker.utils import cdiv


class KVCacheManager:
    """Maps each request to its block table, taking blocks only as its tokens grow."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self._request_to_block_ids: dict[str, list[int]] = {}
        self._request_to_num_slots: dict[str, int] = {}
        self._num_slots_in_use = 0

    def num_blocks_to_grow(self, request: Request, num_new_tokens: int) -> int:
        """Blocks that `allocate_slots(request, num_new_tokens)` would take from the pool."""
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, num_needed - len(self._request_to_block_ids.get(request.request_id, ())))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's block table to hold `num_new_tokens` more tokens.

        Returns the whole block table, or None when the pool has too few free blocks (nothing
        is taken in that case).
        """
        num_new_blocks = self.num_blocks_to_grow(request, num_new_tokens)
        if num_new_blocks > self.block_pool.num_free_blocks:
            return None
        block_ids = self._request_to_block_ids.setdefault(request.request_id, [])
        block_ids.extend(self.block_pool.allocate(num_new_blocks))
        num_slots = request.num_computed_tokens + num_new_tokens
        old_num_slots = self._request_to_num_slots.get(request.request_id, 0)
        if num_slots > old_num_slots:
            self._num_slots_in_use += num_slots - old_num_slots
            self._request_to_num_slots[request.request_id] = num_slots
        return block_ids

    def block_ids(self, request_id: str) -> list[int]:
        return self._request_to_block_ids.get(request_id, [])

    def free(self, request_id: str) -> None:
        block_ids = self._request_to_block_ids.pop(request_id, None)
        if block_ids:
            self.block_pool.free(block_ids)
        self._num_slots_in_use -= self._request_to_num_slots.pop(request_id, 0)

    def stats(self) -> KVCacheStats:
        pool = self.block_pool
        return KVCacheStats(
            block_size=self.block_size,
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_tokens_stored=self._num_slots_in_use,
            num_empty_slots=pool.num_used_blocks * self.block_size - self._num_slots_in_use,
        )
