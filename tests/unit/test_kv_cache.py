from __future__ import annotations

import pytest

from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.request import Request
from qworker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 8) -> Request:
    return Request(request_id, list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens))


def test_blocks_are_taken_as_tokens_grow() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", 6)
    assert manager.allocate_slots(request, 6) == [0, 1]
    request.num_computed_tokens = 6
    # Positions 6 and 7 fit in block 1: nothing new taken.
    assert manager.allocate_slots(request, 2) == [0, 1]
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1) == [0, 1, 2]
    stats = manager.stats()
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.num_tokens_stored) == (3, 5, 9)
    # Only the tail of the last block is empty.
    assert stats.num_empty_slots == 3


def test_allocation_fails_without_taking_anything() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a", 8), make_request("b", 8)
    assert manager.allocate_slots(a, 8) == [0, 1]
    assert manager.allocate_slots(b, 8) is None
    assert manager.stats().num_free_blocks == 1
    assert manager.block_ids("b") == []


def test_free_returns_blocks_in_order() -> None:
    # Without prefix caching; with it, a request's blocks are freed last block first.
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a, b = make_request("a", 4), make_request("b", 2)
    assert manager.allocate_slots(a, 4) == [0, 1]
    assert manager.allocate_slots(b, 2) == [2]
    manager.free("a")
    stats = manager.stats()
    assert (stats.num_free_blocks, stats.num_tokens_stored, stats.num_empty_slots) == (3, 2, 0)
    c = make_request("c", 6)
    # Free list is FIFO: the never-used block 3 first, then a's blocks.
    assert manager.allocate_slots(c, 6) == [3, 0, 1]


def test_double_free_is_an_invariant_violation() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=2)
    manager.allocate_slots(make_request("a", 2), 2)
    manager.free("a")
    manager.free("a")  # unknown request: a no-op
    with pytest.raises(AssertionError, match="freed twice"):
        manager.block_pool.free([0])
