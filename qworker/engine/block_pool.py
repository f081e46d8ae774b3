from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from qworker.engine.block_hash import BlockHash


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the KV cache, in blocks and token slots.

    Free blocks include the evictable ones: cached blocks that no request holds, which the next
    allocation may take (dropping their cache entry). Used blocks are those some request holds.
    """

    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    # Tokens whose KV is stored or reserved for this step, each shared block counted once.
    num_tokens_stored: int
    # Slots in used blocks that hold no token: only the tail of each request's last block.
    num_empty_slots: int
    # Blocks in the prefix cache's table, held or not.
    num_cached_blocks: int = 0
    # Cached blocks that no request holds (part of num_free_blocks).
    num_evictable_blocks: int = 0
    # Since the engine started, over requests admitted (a resumed request counts again): their
    # tokens when admitted, and how many of those the prefix cache held.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.num_prefix_cache_queries:
            return 0.0
        return self.num_prefix_cache_hits / self.num_prefix_cache_queries


class BlockPool:
    """Fixed-size KV blocks: a reference count per block, a free queue, and the prefix cache.

    Blocks are ids into the per-layer cache tensors of shape
    [num_blocks, block_size, num_kv_heads, head_dim]; the pool never touches the tensors.

    A block is free when no request holds it (count 0). Free blocks wait in a queue in the order
    they were freed: `allocate` takes from the head, the least recently used. A free block may
    still be cached (have a hash in the table): `touch` takes it back out of the queue for a
    request that reuses it, and `allocate` evicts it (drops its hash) when it reaches the head.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Insertion-ordered set: the head is the next block to allocate. O(1) removal from the
        # middle, which `touch` needs.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block_id: dict[BlockHash, int] = {}
        self._num_evictable_blocks = 0

    # -- counts ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block_id)

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order `allocate` takes them."""
        return list(self._free_queue)

    # -- taking and returning ----------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue, evicting cached ones."""
        assert 0 <= num_blocks <= self.num_free_blocks, (
            f"asked for {num_blocks} blocks with {self.num_free_blocks} free"
        )
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            assert self._ref_counts[block_id] == 0, f"free block {block_id} is held"
            block_hash = self._block_hashes[block_id]
            if block_hash is not None:
                assert self._hash_to_block_id[block_hash] == block_id, f"block {block_id}'s hash is stale"
                del self._hash_to_block_id[block_hash]
                self._block_hashes[block_id] = None
                self._num_evictable_blocks -= 1
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more holder for each of these cached blocks; free ones leave the free queue."""
        for block_id in block_ids:
            assert self._block_hashes[block_id] is not None, f"block {block_id} is not cached"
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
                self._num_evictable_blocks -= 1
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """One holder fewer for each block; a block nobody holds joins the free queue's tail."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                if self._block_hashes[block_id] is not None:
                    self._num_evictable_blocks += 1

    # -- the prefix cache --------------------------------------------------------------------

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        return self._hash_to_block_id.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Enter a held, full block under its content hash. False when another block already
        holds that content: this one then stays private and is never shared."""
        assert self._ref_counts[block_id] > 0, f"block {block_id} is cached while free"
        assert self._block_hashes[block_id] is None, f"block {block_id} is cached twice"
        if block_hash in self._hash_to_block_id:
            return False
        self._hash_to_block_id[block_hash] = block_id
        self._block_hashes[block_id] = block_hash
        return True

    def uncache_block(self, block_id: int) -> None:
        """Drop a block's cache entry (its K/V turned out not to be computed); held or free."""
        block_hash = self._block_hashes[block_id]
        if block_hash is None:
            return
        del self._hash_to_block_id[block_hash]
        self._block_hashes[block_id] = None
        if self._ref_counts[block_id] == 0:
            self._num_evictable_blocks -= 1
