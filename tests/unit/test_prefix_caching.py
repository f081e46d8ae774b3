"""Prefix caching: exact block ids and orders in the KV cache manager and the scheduler (hits,
partial hits, LRU eviction, the last-token rule, counters), then the tiny engine (outputs equal
with the cache on and off, seeded sampling) and the worker's admission with the cache."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from qworker.engine.kv_cache_manager import CachedPrefix, KVCacheManager
from qworker.engine.request import Request, RequestStatus
from qworker.engine.runner_output import RunnerOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler import Scheduler, SchedulerOutput
from tests.conftest import run_to_completion, run_with_staggered_arrivals, tiny_engine

pytestmark = pytest.mark.timeout(60)

BLOCK = 4


def make_request(request_id: str, token_ids: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens))


def compute(
    manager: KVCacheManager, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None
):
    """What the scheduler and a step do for one request: take slots, compute, cache full blocks."""
    block_ids = manager.allocate_slots(request, num_new_tokens, prefix)
    assert block_ids is not None
    if prefix is not None:
        request.num_computed_tokens = prefix.num_tokens
    request.num_computed_tokens += num_new_tokens
    manager.cache_blocks(request)
    return list(block_ids)


def admit(manager: KVCacheManager, request: Request) -> tuple[int, list[int]]:
    """A waiting request's whole prompt in one step: (tokens hit, block table)."""
    prefix = manager.find_cached_prefix(request)
    return prefix.num_tokens, compute(manager, request, request.num_tokens - prefix.num_tokens, prefix)


# -- the KV cache manager ---------------------------------------------------------------------


def test_full_blocks_are_cached_after_they_are_computed() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = make_request("a", list(range(10)))
    # A first chunk of 6 tokens fills block 0 only.
    assert compute(manager, a, 6, manager.find_cached_prefix(a)) == [0, 1]
    assert manager.stats().num_cached_blocks == 1
    assert compute(manager, a, 4) == [0, 1, 2]
    # Blocks 0 and 1 are full; block 2 holds 2 of 4 tokens and stays private.
    pool = manager.block_pool
    assert [pool.block_hash(b) is not None for b in (0, 1, 2)] == [True, True, False]
    assert a.block_hashes == [pool.block_hash(0), pool.block_hash(1)]


def test_hit_shares_whole_blocks_and_the_rest_is_computed() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    a = make_request("a", list(range(10)))
    assert admit(manager, a) == (0, [0, 1, 2])
    # Same 8 tokens, then different ones: blocks 0 and 1 are shared, the tail is new.
    b = make_request("b", [*range(8), 50, 51, 52])
    assert admit(manager, b) == (8, [0, 1, 3])
    pool = manager.block_pool
    assert [pool.ref_count(block) for block in range(4)] == [2, 2, 1, 1]
    # Partial hit: the first 6 tokens match, so only block 0 (a block is shared whole or not at all).
    c = make_request("c", [*range(6), 60, 61, 62, 63])
    assert admit(manager, c) == (4, [0, 4, 5])
    # A different first token: nothing matches, even though later tokens agree.
    d = make_request("d", [99, *range(1, 10)])
    assert admit(manager, d) == (0, [6, 7, 8])
    stats = manager.stats()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (10 + 11 + 10 + 10, 8 + 4)
    assert stats.num_used_blocks == 9
    # Tokens stored count each shared block once: 9 blocks, 2 empty slots in a's, d's, c's last block.
    assert (stats.num_tokens_stored, stats.num_empty_slots) == (9 * BLOCK - 2 - 1 - 2 - 2, 7)


def test_last_token_is_always_computed_in_a_private_block() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK)
    pool = manager.block_pool
    a = make_request("a", list(range(8)))
    assert admit(manager, a) == (0, [0, 1])
    assert manager.stats().num_cached_blocks == 2
    # The whole prompt is cached, but its last token must be computed: the hit stops one block
    # short and block 1's tokens are computed again into a new block of b's own.
    b = make_request("b", list(range(8)))
    prefix = manager.find_cached_prefix(b)
    assert (prefix.block_ids, prefix.num_tokens) == ((0,), 4)
    assert compute(manager, b, 4, prefix) == [0, 2]
    # Block 2 now holds what block 1 holds: the cache keeps block 1, block 2 stays private.
    assert (pool.block_hash(2), pool.cached_block_id(b.block_hashes[1])) == (None, 1)
    # One token past the cached blocks: both are shared, one token is computed.
    c = make_request("c", list(range(9)))
    assert admit(manager, c) == (8, [0, 1, 3])
    # One token short of them: the hit is block 0, and 3 tokens are computed.
    d = make_request("d", list(range(7)))
    assert admit(manager, d) == (4, [0, 4])
    # A single-token prompt never hits.
    e = make_request("e", [0])
    assert admit(manager, e) == (0, [5])


def test_free_keeps_blocks_cached_and_eviction_is_lru_tail_first() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    pool = manager.block_pool
    a = make_request("a", list(range(10)))  # blocks 0, 1 full and cached, 2 partial
    b = make_request("b", list(range(100, 109)))  # blocks 3, 4 full and cached, 5 partial
    admit(manager, a)
    admit(manager, b)
    manager.free("a")
    manager.free("b")
    # Freed last block first, a before b; cached blocks stay in the table.
    assert pool.free_block_ids() == [2, 1, 0, 5, 4, 3]
    stats = manager.stats()
    assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_evictable_blocks) == (6, 4, 4)
    # Reuse takes a's blocks out of the free queue; the new tail block comes from the head.
    a2 = make_request("a2", [*range(8), 7, 7])
    assert admit(manager, a2) == (8, [0, 1, 2])
    assert pool.free_block_ids() == [5, 4, 3]
    # A new prompt evicts b's blocks, least recently freed first: the partial 5, then 4 (its
    # second cached block) before 3 (its first), so what survives is still a usable prefix.
    c = make_request("c", list(range(200, 205)))
    assert admit(manager, c) == (0, [5, 4])
    assert (pool.block_hash(4), pool.block_hash(3) is not None) == (None, True)
    b2 = make_request("b2", list(range(100, 109)))
    assert manager.find_cached_prefix(b2).block_ids == (3,)
    # Block 5 is c's now, full, and cached under c's tokens: 0, 1, 3 and 5 are in the table.
    stats = manager.stats()
    assert (stats.num_cached_blocks, stats.num_evictable_blocks, stats.num_free_blocks) == (4, 1, 1)


def test_touch_and_shared_counts_and_reuse_after_all_holders_leave() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    pool = manager.block_pool
    prompt = list(range(12))
    a, b = make_request("a", [*prompt, 1]), make_request("b", [*prompt, 2])
    admit(manager, a)
    assert manager.num_shared_prefix_tokens(b) == 12
    admit(manager, b)
    assert [pool.ref_count(x) for x in (0, 1, 2)] == [2, 2, 2]
    manager.free("a")
    assert [pool.ref_count(x) for x in (0, 1, 2)] == [1, 1, 1]
    manager.free("b")
    # Cached but held by nobody: a request would reuse them, but they cost free blocks.
    c = make_request("c", [*prompt, 3])
    assert manager.num_shared_prefix_tokens(c) == 0
    assert manager.find_cached_prefix(c).num_tokens == 12
    assert manager.stats().num_evictable_blocks == 3


def test_allocation_counts_revived_cached_blocks_against_free_ones() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = make_request("a", list(range(12)))
    admit(manager, a)  # blocks 0, 1, 2 full and cached
    manager.free("a")
    assert manager.block_pool.free_block_ids() == [3, 2, 1, 0]
    b = make_request("b", list(range(8)) + [9] * 8)
    prefix = manager.find_cached_prefix(b)
    assert prefix.block_ids == (0, 1)
    # 2 revived + 3 new (17 slots) > 4 free: nothing is taken.
    assert manager.allocate_slots(b, 9, prefix) is None
    stats = manager.stats()
    assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_prefix_cache_queries) == (4, 3, 12)
    # 2 revived + 2 new fit; the new ones come from the head: 3, then 2 (evicting a's last block).
    assert manager.allocate_slots(b, 8, prefix) == [0, 1, 3, 2]
    assert manager.stats().num_cached_blocks == 2


def test_caching_off_never_hits_or_caches() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    a = make_request("a", list(range(10)))
    admit(manager, a)
    manager.free("a")
    b = make_request("b", list(range(10)))
    assert admit(manager, b) == (0, [3, 4, 5])
    stats = manager.stats()
    assert (stats.num_cached_blocks, stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (0, 0, 0)
    assert b.block_hashes == []


# -- the scheduler ------------------------------------------------------------------------------


def make_scheduler(num_blocks=16, max_num_batched_tokens=16, **kw) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BLOCK), max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, **kw
    )


def summary(plan: SchedulerOutput) -> list[tuple[str, int, int, list[int]]]:
    return [(s.request_id, s.start_position, len(s.token_ids), s.block_ids) for s in plan.scheduled]


def step(scheduler: Scheduler, plan: SchedulerOutput, token: int = 7) -> None:
    # The scheduler finishes requests at max_tokens itself.
    sampled = {s.request_id: token for s in plan.scheduled if s.needs_sample}
    scheduler.update_from_output(plan, RunnerOutput(sampled=sampled))


def test_scheduler_starts_after_the_cached_prefix_and_charges_no_budget_for_it() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", list(range(16)), max_tokens=1))
    plan = scheduler.schedule()
    assert summary(plan) == [("a", 0, 8, [0, 1])]
    step(scheduler, plan)
    # The chunk's full blocks are cached after the step: b joins now and shares them.
    scheduler.add_request(make_request("b", [*range(8), 40, 41, 42], max_tokens=1))
    plan = scheduler.schedule()
    assert summary(plan) == [("a", 8, 8, [0, 1, 2, 3])]  # a's chunk takes the whole budget
    step(scheduler, plan)
    plan = scheduler.schedule()
    # b skips the 8 cached tokens: 3 tokens of budget, not 11.
    assert summary(plan) == [("b", 8, 3, [0, 1, 4])]
    assert plan.num_scheduled_tokens == 3
    assert scheduler.num_prompt_tokens_computed == 16 + 3
    step(scheduler, plan)
    assert not scheduler.has_unfinished_requests()
    stats = scheduler.kv_cache_manager.stats()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (16 + 11, 8)
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_evictable_blocks) == (0, 4, 4)


def test_whole_prompt_cached_recomputes_its_last_block() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", list(range(8)), max_tokens=1))
    step(scheduler, scheduler.schedule())
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("b", list(range(8)), max_tokens=2))
    plan = scheduler.schedule()
    # Block 0 is shared; tokens 4..7 are computed into a new block, and the last one is sampled.
    assert summary(plan) == [("b", 4, 4, [0, 2])]
    assert plan.scheduled[0].needs_sample
    step(scheduler, plan)
    plan = scheduler.schedule()
    assert summary(plan) == [("b", 8, 1, [0, 2, 3])]


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    # 5 blocks of 4: two 7-token prompts take 2 blocks each, and both need a third at position 8.
    scheduler = make_scheduler(num_blocks=5)
    scheduler.add_request(make_request("old", list(range(7)), max_tokens=4))
    new = make_request("new", list(range(100, 107)), max_tokens=4)
    scheduler.add_request(new)
    plans = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        plans.append((plan.preempted_request_ids, summary(plan)))
        step(scheduler, plan)
    assert plans == [
        ([], [("old", 0, 7, [0, 1]), ("new", 0, 7, [2, 3])]),
        ([], [("old", 7, 1, [0, 1]), ("new", 7, 1, [2, 3])]),
        # One free block: "new" is preempted; its two full blocks stay cached.
        (["new"], [("old", 8, 1, [0, 1, 4])]),
        # "new" would reuse blocks 2 and 3 and take a third: 3 > the 2 free ones.
        ([], [("old", 9, 1, [0, 1, 4])]),
        # Resumed: its prompt and first output are cached; only position 8 is computed.
        ([], [("new", 8, 1, [2, 3, 4])]),
        ([], [("new", 9, 1, [2, 3, 4])]),
    ]
    stats = scheduler.kv_cache_manager.stats()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (7 + 7 + 9, 8)
    assert scheduler.num_prompt_tokens_computed == 14
    # The resume's 8 hit tokens are its own recompute: the first scheduling hit none.
    assert (new.num_preemptions, new.num_cached_tokens) == (1, 0)


def test_requests_admitted_in_one_plan_share_the_prefix_the_first_computes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", [*range(8), 30, 31], max_tokens=1))
    scheduler.add_request(make_request("b", [*range(8), 40, 41, 42], max_tokens=1))
    scheduler.add_request(make_request("c", [*range(4), 50, 51, 52, 53, 54], max_tokens=1))
    plan = scheduler.schedule()
    # a computes blocks 0 and 1 in this step; b and c read them in the same step (each layer's
    # K/V is written before its attention runs), so they compute only their own tails.
    assert summary(plan) == [("a", 0, 10, [0, 1, 2]), ("b", 8, 3, [0, 1, 3]), ("c", 4, 5, [0, 4, 5])]
    assert scheduler.num_prompt_tokens_computed == 10 + 3 + 5
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.ref_count(block) for block in range(6)] == [3, 2, 1, 1, 1, 1]
    step(scheduler, plan)
    stats = scheduler.kv_cache_manager.stats()
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (10 + 11 + 9, 8 + 4)
    # c's block 4 (its tokens 4..7) was filled in the step and is cached after it.
    assert (stats.num_used_blocks, stats.num_cached_blocks) == (0, 3)


def test_a_chunk_shares_only_the_blocks_it_fills_in_the_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", list(range(15)), max_tokens=1))
    plan = scheduler.schedule()
    assert summary(plan) == [("a", 0, 10, [0, 1, 2])]
    step(scheduler, plan)
    scheduler.add_request(make_request("b", [*range(15), 40], max_tokens=1))
    plan = scheduler.schedule()
    # a's last chunk (10..14) fills block 2 and part of block 3. b shares blocks 0 and 1 (cached
    # after the last step) and block 2 (filled in this one), not a's partial block 3: it
    # computes its tokens 12..15 into a block of its own.
    assert summary(plan) == [("a", 10, 5, [0, 1, 2, 3]), ("b", 12, 4, [0, 1, 2, 4])]
    assert scheduler.num_prompt_tokens_computed == 15 + 4


def test_a_failed_step_takes_the_blocks_cached_at_plan_time_out_of_the_cache() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    manager = scheduler.kv_cache_manager
    scheduler.add_request(make_request("a", [*range(8), 30], max_tokens=1))
    scheduler.add_request(make_request("b", [*range(8), 40], max_tokens=1))
    plan = scheduler.schedule()
    assert summary(plan) == [("a", 0, 9, [0, 1, 2]), ("b", 8, 1, [0, 1, 3])]
    manager.discard_scheduled()
    # Nothing is cached any more; the blocks stay held by a and b, unshared from now on.
    stats = manager.stats()
    assert (stats.num_cached_blocks, stats.num_used_blocks) == (0, 4)
    assert manager.find_cached_prefix(make_request("c", [*range(8), 50])).num_tokens == 0
    for request_id in ("a", "b"):
        scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
    stats = manager.stats()
    assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_evictable_blocks) == (16, 0, 0)


# -- the tiny engine ----------------------------------------------------------------------------


def shared_prefix_prompts(block_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts over one 48-token base: the base itself, then prompts that share exactly k whole
    blocks of it, one token past them, one token short of them, and ones that share nothing."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 256) for _ in range(48)]
    k = max(1, 24 // block_size) * block_size
    tail = [rng.randrange(3, 256) for _ in range(5)]
    return [
        base,
        base[:k] + tail,
        base[: k + 1] + tail,
        base[: k - 1] + tail,
        base[:k],  # exactly k blocks: the whole prompt is cached in round 2
        base[: k + 1],
        base + tail,
        [rng.randrange(3, 256) for _ in range(9)],
        base[:1] + tail,
    ]


def greedy(engine, prompt_list, round_: int, max_tokens: int = 8) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [
        engine.add_request(f"round{round_}-{i}", {"prompt_token_ids": p}, sp)
        for i, p in enumerate(prompt_list)
    ]
    outs = run_to_completion(engine)
    return [outs[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 3},
        {"block_size": 1},
        {"block_size": 16, "max_num_batched_tokens": 7},
        {"block_size": 32},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
        # 16 blocks of 4: the long prompts preempt each other while they grow.
        {"num_kv_blocks": 16},
    ],
    ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default",
)
def test_tiny_engine_gives_the_same_tokens_with_the_cache_on_and_off(tiny_llama, engine_args) -> None:
    block_size = engine_args.get("block_size", 4)
    prompt_list = shared_prefix_prompts(block_size)
    off = tiny_engine(tiny_llama, enable_prefix_caching=False, **engine_args)
    expected = greedy(off, prompt_list, 1)
    assert off.kv_stats().num_prefix_cache_queries == 0
    on = tiny_engine(tiny_llama, **engine_args)
    # One by one first: each prompt finds what the ones before it left in the cache.
    assert [greedy(on, [p], 1)[0] for p in prompt_list] == expected
    first = on.kv_stats()
    assert first.num_prefix_cache_hits > 0
    # Then all at once, every prompt cached in full (up to its last token's block).
    assert greedy(on, prompt_list, 2) == expected
    second = on.kv_stats()
    assert second.num_prefix_cache_hits > first.num_prefix_cache_hits
    assert second.num_used_blocks == 0
    # Two rounds with the cache compute fewer prompt tokens than one without.
    assert on.scheduler.num_prompt_tokens_computed < off.scheduler.num_prompt_tokens_computed


@pytest.mark.parametrize(
    "engine_args", [{}, {"block_size": 16, "max_num_batched_tokens": 80}], ids=["default", "chunked"]
)
def test_tiny_engine_prefix_shared_within_one_step_gives_the_same_tokens(tiny_llama, engine_args) -> None:
    prompt_list = shared_prefix_prompts(engine_args.get("block_size", 4), seed=2)
    off = tiny_engine(tiny_llama, enable_prefix_caching=False, **engine_args)
    expected = greedy(off, prompt_list, 1)
    on = tiny_engine(tiny_llama, **engine_args)
    # All at once on an empty cache: the first step's later prompts read the blocks the first
    # one writes in that very step.
    plan = on.scheduler.schedule
    first_plan = []

    def observed_schedule():
        result = plan()
        first_plan.append(result)
        return result

    on.scheduler.schedule = observed_schedule
    assert greedy(on, prompt_list, 1) == expected
    shared_in_first_step = [s for s in first_plan[0].scheduled if s.start_position > 0]
    assert shared_in_first_step, "no prompt of the first step shared a prefix"
    assert on.kv_stats().num_prefix_cache_hits > 0
    assert on.scheduler.num_prompt_tokens_computed < off.scheduler.num_prompt_tokens_computed


def test_tiny_engine_step_failure_uncaches_the_blocks_of_its_plan(tiny_llama) -> None:
    from qworker.errors import EngineStepError

    engine = tiny_engine(tiny_llama)
    prompt = shared_prefix_prompts(4)[6]
    execute = engine.runner.execute

    def failing_execute(plan):
        raise RuntimeError("injected")

    engine.runner.execute = failing_execute
    engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0.0))
    engine.add_request("b", {"prompt_token_ids": [*prompt, 9]}, SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(EngineStepError):
        engine.step()
    assert engine.kv_stats().num_cached_blocks == 0
    for request_id in ("a", "b"):
        engine.abort(request_id)
    engine.runner.execute = execute
    # The same prompt again computes everything: nothing of the failed step is reused.
    hits_before = engine.kv_stats().num_prefix_cache_hits
    expected = greedy(tiny_engine(tiny_llama, enable_prefix_caching=False), [prompt], 1)
    assert greedy(engine, [prompt], 2) == expected
    assert engine.kv_stats().num_prefix_cache_hits == hits_before


def test_tiny_engine_requests_joining_mid_decode_share_a_prefix(tiny_llama) -> None:
    prompt_list = shared_prefix_prompts(4, seed=1)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    off = tiny_engine(tiny_llama, enable_prefix_caching=False, max_num_batched_tokens=16)
    on = tiny_engine(tiny_llama, max_num_batched_tokens=16)
    expected = run_with_staggered_arrivals(off, prompt_list, sp, steps_between=2)
    assert run_with_staggered_arrivals(on, prompt_list, sp, steps_between=2) == expected
    assert on.kv_stats().num_prefix_cache_hits > 0


def test_seeded_sampling_is_the_same_with_the_prefix_cached_or_not(tiny_llama) -> None:
    prompt = shared_prefix_prompts(4)[6]
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    uncached = tiny_engine(tiny_llama, enable_prefix_caching=False)
    uncached.add_request("x", {"prompt_token_ids": prompt}, sp)
    expected = run_to_completion(uncached)["x"].outputs[0].token_ids
    engine = tiny_engine(tiny_llama)
    # A greedy request with the same prompt fills the cache first.
    engine.add_request("warm", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0.0))
    run_to_completion(engine)
    hits_before = engine.kv_stats().num_prefix_cache_hits
    engine.add_request("x", {"prompt_token_ids": prompt}, sp)
    assert run_to_completion(engine)["x"].outputs[0].token_ids == expected
    assert engine.kv_stats().num_prefix_cache_hits - hits_before == (len(prompt) - 1) // 4 * 4


def test_tiny_engine_reports_the_prompt_tokens_its_first_scheduling_found_cached(tiny_llama) -> None:
    """RequestOutput.num_cached_tokens (OpenAI's usage.prompt_tokens_details.cached_tokens): the
    whole blocks below the last prompt token that the first scheduling found in the cache."""
    engine = tiny_engine(tiny_llama)
    prompt = shared_prefix_prompts(4)[6]  # 53 tokens
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def run(request_id: str, token_ids: list[int], params: SamplingParams = sp):
        engine.add_request(request_id, {"prompt_token_ids": token_ids}, params)
        return run_to_completion(engine)[request_id]

    assert run("first", prompt).num_cached_tokens == 0
    assert run("again", prompt).num_cached_tokens == (len(prompt) - 1) // 4 * 4 == 52
    # A prompt that shares its first 3 blocks and then differs: those 12 tokens.
    assert run("partial", [*prompt[:14], 1, *prompt[15:]]).num_cached_tokens == 12
    # Scoring the prompt computes all of it: nothing is taken from the cache.
    assert run("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0)).num_cached_tokens == 0
    # n = 2: the prompt counts once, as prompt_tokens does; completion 0 computed it (completion 1
    # then took its blocks from the cache).
    rng = random.Random(11)
    fresh = [rng.randrange(3, 256) for _ in range(20)]
    hits_before = engine.kv_stats().num_prefix_cache_hits
    parent = run("n2", fresh, SamplingParams(n=2, max_tokens=2, temperature=1.0, seed=1, ignore_eos=True))
    assert len(parent.outputs) == 2 and parent.num_cached_tokens == 0
    assert engine.kv_stats().num_prefix_cache_hits - hits_before == 16


def test_tiny_engine_cached_tokens_are_not_inflated_by_a_preemption(tiny_llama) -> None:
    # 16 blocks of 4: two 11-token prompts that grow by 24 tokens need 9 blocks each, so the
    # newer one is preempted while they grow, and its resume finds far more than 8 tokens cached.
    engine = tiny_engine(tiny_llama, num_kv_blocks=16)
    rng = random.Random(5)
    shared = [rng.randrange(3, 256) for _ in range(8)]
    engine.add_request("warm", {"prompt_token_ids": [*shared, 7]}, SamplingParams(max_tokens=1))
    run_to_completion(engine)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("older", {"prompt_token_ids": [rng.randrange(3, 256) for _ in range(11)]}, sp)
    engine.add_request("newer", {"prompt_token_ids": [*shared, 40, 41, 42]}, sp)
    hits_before = engine.kv_stats().num_prefix_cache_hits
    outputs = run_to_completion(engine)
    newer = outputs["newer"]
    assert newer.num_preemptions >= 1 and outputs["older"].num_preemptions == 0
    assert engine.kv_stats().num_prefix_cache_hits - hits_before > 8 + 8
    assert (newer.num_cached_tokens, outputs["older"].num_cached_tokens) == (8, 0)


def test_abort_mid_prefill_leaves_what_was_computed_cached(tiny_llama) -> None:
    prompt = shared_prefix_prompts(4)[6]  # 53 tokens
    engine = tiny_engine(tiny_llama, max_num_batched_tokens=10)
    engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    engine.step()
    assert engine.num_cached_prefix_tokens("a") == 20  # 20 tokens computed: 5 full blocks, held
    engine.abort("a")
    stats = engine.kv_stats()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_evictable_blocks) == (0, 5, 5)
    expected = greedy(tiny_engine(tiny_llama, enable_prefix_caching=False), [prompt], 1)
    assert greedy(engine, [prompt], 2) == expected
    assert engine.kv_stats().num_prefix_cache_hits == 20
    assert engine.num_cached_prefix_tokens("unknown") == 0


# -- admission with the cache (the worker on the in-memory queue, a tiny real engine) ---------


class ObservedEngine:
    """Calls `on_step` after each step of the real engine it wraps: the test's look mid-run."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.on_step = lambda: None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self):
        outputs = self._engine.step()
        self.on_step()
        return outputs


def run_worker_on_shared_prefix_jobs(tiny_llama, enable_prefix_caching: bool) -> dict[str, Any]:
    from qworker.backends.memory.queue import MemoryQueue, MemorySource
    from qworker.backends.memory.results import MemoryResultSink
    from qworker.worker.loop import Worker
    from qworker.worker.settings import WorkerSettings

    # 56 blocks of 4: a 43-token prompt takes 11 blocks and grows to 13 with its 6 tokens, so
    # four such jobs fill the pool unless they share their 40-token (10-block) prefix.
    engine = ObservedEngine(
        tiny_engine(
            tiny_llama,
            num_kv_blocks=56,
            block_size=4,
            max_num_seqs=16,
            enable_prefix_caching=enable_prefix_caching,
        )
    )
    rng = random.Random(3)
    prefix = [rng.randrange(3, 256) for _ in range(40)]
    queue = MemoryQueue("jobs")
    sink = MemoryResultSink()
    for i in range(24):
        body = {
            "prompt_token_ids": prefix + [rng.randrange(3, 256) for _ in range(3)],
            "params": {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        }
        queue.put(json.dumps(body).encode(), f"j{i}")
    max_backlog = 2
    worker = Worker(
        engine,
        MemorySource(queue, consumer="w1"),
        sink,
        WorkerSettings(name="w1", max_backlog=max_backlog, poll_interval_s=0.01, cancel_check_interval_s=0.0),
    )
    seen = {"max_running": 0, "max_held": 0}

    def check() -> None:
        admission = worker.admission_stats()
        num_running = admission.num_jobs_held - admission.num_jobs_not_started
        # The documented bound: held <= running + max_backlog.
        assert admission.num_jobs_not_started <= max_backlog, admission
        assert admission.num_jobs_held <= num_running + max_backlog, admission
        seen["max_running"] = max(seen["max_running"], len(engine.scheduler.running))
        seen["max_held"] = max(seen["max_held"], admission.num_jobs_held)

    engine.on_step = check
    stats = worker.run(burst=True)
    assert stats.num_completed == 24
    assert queue.depth() == 0
    seen["num_preemptions"] = engine.scheduler.num_preemptions
    seen["stats"] = engine.kv_stats()
    # The stored results' JSON, as consumers read it back.
    results = [json.loads(sink.get_result(f"j{i}").model_dump_json()) for i in range(24)]  # type: ignore[union-attr]
    seen["cached_tokens"] = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results]
    return seen


@pytest.mark.timeout(120)
def test_admission_holds_more_jobs_when_they_share_a_cached_prefix(tiny_llama) -> None:
    off = run_worker_on_shared_prefix_jobs(tiny_llama, enable_prefix_caching=False)
    on = run_worker_on_shared_prefix_jobs(tiny_llama, enable_prefix_caching=True)
    assert off["max_running"] <= 4
    assert on["max_running"] >= 8, on
    assert on["max_held"] > off["max_held"]
    assert on["stats"].num_prefix_cache_hits >= 20 * 40
    # Each result says what its prompt found: the first job nothing, every later one the shared
    # prefix's 10 blocks; with the cache off, nothing.
    assert off["cached_tokens"] == [0] * 24
    assert on["cached_tokens"] == [0] + [40] * 23
