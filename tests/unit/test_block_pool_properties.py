"""Property tests of the block pool and KV cache manager with prefix caching (hypothesis).

A state machine adds requests (prompts drawn from a few shared prefixes over a 3-token alphabet,
so that hits are common), steps them (admission with the cached prefix, prefill chunks, decodes
with a sampled token), finishes, aborts and preempts them, on a small pool where eviction is
frequent. A shadow model writes each computed token into its slot of a shadow KV cache, as the
model would, and checks after every rule:
- a request holds no block twice; a block's reference count is the number of requests holding it;
  free blocks are exactly those nobody holds;
- a computed token is only ever written into a block that one request holds and that is not
  cached (a cached block is never written while another request reads it);
- every computed position of every request reads its own token from the shadow cache (so a hit
  shares only blocks whose contents match);
- the hash table points only to blocks whose contents are the tokens the hash was made from;
- allocation (and so eviction) never takes a block that a request holds.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from qworker.engine.block_hash import BlockHash
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.request import Request
from qworker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

PREFIXES = [[0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 1, 0, 0], [1]]


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.manager = KVCacheManager(num_blocks, block_size, cache_salt="test")
        self.pool = self.manager.block_pool
        self.num_blocks = num_blocks
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Shadow KV cache: block id -> the token written in each slot (None: never written).
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        # Every hash the requests made -> the whole token prefix it stands for.
        self.hash_to_tokens: dict[BlockHash, tuple[int, ...]] = {}
        self.next_id = 0

    # -- helpers -----------------------------------------------------------------------------

    def held_by_others(self, request: Request) -> set[int]:
        return {b for r in self.running if r is not request for b in self.manager.block_ids(r.request_id)}

    def compute(self, request: Request, num_new_tokens: int) -> None:
        """The model writes KV for positions [computed, computed + n); then blocks are cached."""
        block_ids = self.manager.block_ids(request.request_id)
        start = request.num_computed_tokens
        for position in range(start, start + num_new_tokens):
            block_id = block_ids[position // self.block_size]
            assert self.pool.ref_count(block_id) == 1, f"write into block {block_id} that others hold"
            assert self.pool.block_hash(block_id) is None, f"write into cached block {block_id}"
            self.slots[block_id][position % self.block_size] = request.token_ids[position]
        request.num_computed_tokens += num_new_tokens
        self.manager.cache_blocks(request)
        self.record_hashes(request)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(request.num_tokens % 3)  # a deterministic "sample"

    def record_hashes(self, request: Request) -> None:
        for i, block_hash in enumerate(request.block_hashes):
            prefix = tuple(request.token_ids[: (i + 1) * self.block_size])
            assert self.hash_to_tokens.setdefault(block_hash, prefix) == prefix, "hash collision"

    def release(self, request: Request) -> None:
        self.manager.free(request.request_id)
        self.running.remove(request)

    # -- rules -------------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 2), max_size=6))
    def add(self, prefix: list[int], tail: list[int]) -> None:
        self.next_id += 1
        self.waiting.append(Request(f"r{self.next_id}", prefix + tail, SamplingParams(max_tokens=8)))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.waiting))
        prefix = self.manager.find_cached_prefix(request)
        assert prefix.num_tokens < request.num_tokens, "the last token is always computed"
        assert prefix.num_tokens == len(prefix.block_ids) * self.block_size
        num_new_tokens = data.draw(st.integers(1, request.num_tokens - prefix.num_tokens))
        held_before = self.held_by_others(request)
        block_ids = self.manager.allocate_slots(request, num_new_tokens, prefix)
        if block_ids is None:
            return
        assert block_ids[: len(prefix.block_ids)] == list(prefix.block_ids)
        new_blocks = block_ids[len(prefix.block_ids) :]
        assert not set(new_blocks) & held_before, "allocation took a block in use"
        self.waiting.remove(request)
        self.running.append(request)
        request.num_computed_tokens = prefix.num_tokens
        self.compute(request, num_new_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running))
        num_remaining = request.num_tokens - request.num_computed_tokens
        num_new_tokens = data.draw(st.integers(1, num_remaining))
        held_before = self.held_by_others(request)
        num_before = len(self.manager.block_ids(request.request_id))
        block_ids = self.manager.allocate_slots(request, num_new_tokens)
        if block_ids is None:
            return
        assert not set(block_ids[num_before:]) & held_before, "allocation took a block in use"
        self.compute(request, num_new_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), aborted=st.booleans())
    def finish(self, data: st.DataObject, aborted: bool) -> None:
        # Finished and aborted requests leave the same way: their blocks are released at once.
        self.release(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.waiting))
        self.manager.free(request.request_id)  # holds nothing: a no-op
        self.waiting.remove(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running))
        self.release(request)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def reference_counts_are_holders(self) -> None:
        holders = [0] * self.num_blocks
        for request in self.running:
            block_ids = self.manager.block_ids(request.request_id)
            assert len(block_ids) == len(set(block_ids)), f"{request.request_id} holds a block twice"
            for block_id in block_ids:
                holders[block_id] += 1
        for request in self.waiting:
            assert self.manager.block_ids(request.request_id) == []
        for block_id in range(self.num_blocks):
            assert self.pool.ref_count(block_id) == holders[block_id], f"block {block_id}"
        free = set(self.pool.free_block_ids())
        assert free == {b for b in range(self.num_blocks) if holders[b] == 0}
        stats = self.manager.stats()
        assert stats.num_free_blocks + stats.num_used_blocks == self.num_blocks
        assert stats.num_empty_slots >= 0

    @invariant()
    def shared_blocks_are_full_and_cached(self) -> None:
        for block_id in range(self.num_blocks):
            if self.pool.ref_count(block_id) > 1:
                assert self.pool.block_hash(block_id) is not None, f"shared block {block_id} is not cached"

    @invariant()
    def every_request_reads_its_own_tokens(self) -> None:
        for request in self.running:
            block_ids = self.manager.block_ids(request.request_id)
            for position in range(request.num_computed_tokens):
                block_id = block_ids[position // self.block_size]
                assert self.slots[block_id][position % self.block_size] == request.token_ids[position], (
                    f"{request.request_id} position {position} reads another token"
                )

    @invariant()
    def hash_table_points_to_matching_contents(self) -> None:
        num_cached = 0
        num_evictable = 0
        for block_id in range(self.num_blocks):
            block_hash = self.pool.block_hash(block_id)
            if block_hash is None:
                continue
            num_cached += 1
            num_evictable += self.pool.ref_count(block_id) == 0
            assert self.pool.cached_block_id(block_hash) == block_id
            tokens = self.hash_to_tokens[block_hash]
            assert self.slots[block_id] == list(tokens[-self.block_size :]), f"block {block_id}"
        stats = self.manager.stats()
        assert (stats.num_cached_blocks, stats.num_evictable_blocks) == (num_cached, num_evictable)


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
