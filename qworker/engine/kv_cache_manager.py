"""Each request's block table, taken from the block pool as its tokens grow, and the prefix cache.

With prefix caching on, a full block whose KV has been computed is entered in the pool's table
under its content hash (qworker/engine/block_hash.py). A new or resumed request then starts with
the longest run of its own full blocks found there: it shares those blocks (their reference
counts go up) and counts their tokens as computed. Only full blocks are ever shared, and a full
block is never written again: its owner writes only past it, and a request that reuses it writes
only into blocks after its cached prefix, because the hit is whole blocks. A request's partial
last block is always its own.

The hit is capped at whole blocks below the request's last token, so that the last token is
always computed (its logits give the next token) and is written into a private block: with the
whole prompt cached, the last block is recomputed rather than shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qworker.engine.block_hash import BlockHash, extend_block_hashes, root_block_hash
from qworker.engine.block_pool import BlockPool, KVCacheStats
from qworker.engine.request import Request
from qworker.utils import cdiv


@dataclass(frozen=True)
class CachedPrefix:
    """The cached blocks a waiting request would start from, and the tokens they hold."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


@dataclass
class _RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    # Slots reserved: the tokens computed plus those scheduled this step.
    num_slots: int = 0
    # Leading blocks already entered in the prefix cache (or found there, or duplicates of a
    # cached block): registration resumes after them.
    num_cached_blocks: int = 0


class KVCacheManager:
    """Maps each request to its block table, taking blocks only as its tokens grow.

    `cache_salt` goes into the root of every block hash: whatever besides the token ids decides
    a block's KV (the engine passes its model and dtype).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, cache_salt: str = ""
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._cache_salt = cache_salt
        self._root_hash = root_block_hash(cache_salt)
        # Roots of requests run with a LoRA adapter, by the adapter's cache key.
        self._lora_roots: dict[str, BlockHash] = {}
        self._requests: dict[str, _RequestBlocks] = {}
        # Sum over requests of the empty slots of their last block. Shared blocks are full, so
        # used blocks * block_size - this is the tokens stored, each shared block counted once.
        self._num_empty_slots = 0
        self._num_queries = 0
        self._num_hits = 0
        # Blocks entered in the prefix cache by `cache_scheduled_blocks` for the step planned
        # but not yet run.
        self._scheduled_block_ids: list[int] = []

    # -- the prefix cache --------------------------------------------------------------------

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        root = (
            self._root_hash
            if request.lora_request is None
            else self._lora_root(request.lora_request.cache_key)
        )
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size, root)
        return request.block_hashes

    def _lora_root(self, key: str) -> BlockHash:
        root = self._lora_roots.get(key)
        if root is None:
            if len(self._lora_roots) >= 4096:
                self._lora_roots.clear()
            root = self._lora_roots[key] = root_block_hash(self._cache_salt, (key,))
        return root

    def _cached_run(self, request: Request) -> list[int]:
        """Block ids of the longest cached run of the request's full blocks below its last token."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in self._block_hashes(request)[:max_blocks]:
            block_id = self.block_pool.cached_block_id(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The cached prefix a waiting request would start from. Changes nothing in the cache
        (the request keeps its block hashes, computed once)."""
        if not self.enable_prefix_caching:
            return CachedPrefix()
        assert request.request_id not in self._requests, f"request {request.request_id} already has blocks"
        block_ids = self._cached_run(request)
        return CachedPrefix(tuple(block_ids), len(block_ids) * self.block_size)

    def num_shared_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's cached prefix in blocks that requests hold now: starting it
        would share them without taking a free block. Cached blocks nobody holds are not
        counted: they are free blocks, and reusing one takes it off the free queue."""
        if not self.enable_prefix_caching:
            return 0
        pool = self.block_pool
        return sum(1 for b in self._cached_run(request) if not pool.is_free(b)) * self.block_size

    def cache_blocks(self, request: Request) -> None:
        """Enter the request's blocks that its computed tokens fill (after a step computed them)."""
        self._cache_full_blocks(request, request.num_computed_tokens)

    def cache_scheduled_blocks(self, request: Request, num_tokens: int) -> None:
        """At plan time, enter the blocks that the step being planned fills (the request's first
        `num_tokens` tokens), so that a request admitted later in the same plan shares them
        instead of computing the same prefix again: the step writes each layer's K/V for every
        scheduled token before that layer's attention reads any. Until `commit_scheduled()` says
        the step ran, `discard_scheduled()` takes them out again."""
        self._scheduled_block_ids.extend(self._cache_full_blocks(request, num_tokens))

    def commit_scheduled(self) -> None:
        """The planned step ran: the blocks entered at plan time hold their K/V."""
        self._scheduled_block_ids.clear()

    def discard_scheduled(self) -> None:
        """The planned step failed: the blocks entered at plan time may hold no K/V, so they leave
        the prefix cache (their holders keep them, unshared)."""
        for block_id in self._scheduled_block_ids:
            self.block_pool.uncache_block(block_id)
        self._scheduled_block_ids.clear()

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Enter the blocks that the request's first `num_tokens` tokens fill; the ids entered."""
        if not self.enable_prefix_caching:
            return []
        blocks = self._requests.get(request.request_id)
        if blocks is None:
            return []
        num_full_blocks = num_tokens // self.block_size
        if num_full_blocks <= blocks.num_cached_blocks:
            return []
        block_hashes = self._block_hashes(request)
        pool = self.block_pool
        entered = [
            blocks.block_ids[i]
            for i in range(blocks.num_cached_blocks, num_full_blocks)
            if pool.cache_block(blocks.block_ids[i], block_hashes[i])
        ]
        blocks.num_cached_blocks = num_full_blocks
        return entered

    # -- block tables ------------------------------------------------------------------------

    def num_blocks_to_grow(self, request: Request, num_new_tokens: int) -> int:
        """Blocks that `allocate_slots(request, num_new_tokens)` would take from the pool."""
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        blocks = self._requests.get(request.request_id)
        return max(0, num_needed - (len(blocks.block_ids) if blocks is not None else 0))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: CachedPrefix | None = None
    ) -> list[int] | None:
        """Grow the request's block table to hold `num_new_tokens` more tokens.

        A waiting request passes its `find_cached_prefix()`: its table starts with those blocks,
        and the new tokens come after them. Returns the whole block table, or None when the pool
        has too few free blocks (nothing is taken in that case).
        """
        pool = self.block_pool
        blocks = self._requests.get(request.request_id)
        num_computed = request.num_computed_tokens
        cached_ids: tuple[int, ...] = ()
        if cached_prefix is not None:
            assert blocks is None and num_computed == 0, f"request {request.request_id} is not waiting"
            cached_ids = cached_prefix.block_ids
            num_computed = cached_prefix.num_tokens
        num_held = len(blocks.block_ids) if blocks is not None else len(cached_ids)
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - num_held)
        # Reusing a cached block that nobody holds takes it off the free queue too.
        num_revived = sum(1 for b in cached_ids if pool.is_free(b))
        if num_new_blocks + num_revived > pool.num_free_blocks:
            return None
        if blocks is None:
            blocks = self._requests[request.request_id] = _RequestBlocks()
        old_num_empty = len(blocks.block_ids) * self.block_size - blocks.num_slots
        if cached_prefix is not None:
            # Before allocating: allocation must not evict the blocks about to be reused.
            pool.touch(cached_ids)
            blocks.block_ids.extend(cached_ids)
            blocks.num_cached_blocks = len(cached_ids)
            if self.enable_prefix_caching:
                self._num_queries += request.num_tokens
                self._num_hits += cached_prefix.num_tokens
        blocks.block_ids.extend(pool.allocate(num_new_blocks))
        blocks.num_slots = max(blocks.num_slots, num_computed + num_new_tokens)
        self._num_empty_slots += len(blocks.block_ids) * self.block_size - blocks.num_slots - old_num_empty
        return blocks.block_ids

    def block_ids(self, request_id: str) -> list[int]:
        blocks = self._requests.get(request_id)
        return blocks.block_ids if blocks is not None else []

    def free(self, request_id: str) -> None:
        """Release a request's blocks. Cached ones stay cached until evicted; with caching on they
        are released last block first, so that eviction takes a prefix's tail before its head."""
        blocks = self._requests.pop(request_id, None)
        if blocks is None:
            return
        self._num_empty_slots -= len(blocks.block_ids) * self.block_size - blocks.num_slots
        if self.enable_prefix_caching:
            self.block_pool.free(reversed(blocks.block_ids))
        else:
            self.block_pool.free(blocks.block_ids)

    def stats(self) -> KVCacheStats:
        pool = self.block_pool
        num_used = pool.num_used_blocks
        return KVCacheStats(
            block_size=self.block_size,
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=num_used,
            num_tokens_stored=num_used * self.block_size - self._num_empty_slots,
            num_empty_slots=self._num_empty_slots,
            num_cached_blocks=pool.num_cached_blocks,
            num_evictable_blocks=pool.num_evictable_blocks,
            num_prefix_cache_queries=self._num_queries,
            num_prefix_cache_hits=self._num_hits,
        )
