from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qworker.config import SchedulingPolicy
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.request import Request, RequestStatus
from qworker.engine.runner_output import RunnerOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler import Scheduler, SchedulerOutput

pytestmark = pytest.mark.timeout(120)


def make_scheduler(
    num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=False, **kw
) -> Scheduler:
    # Prefix caching off unless asked: these prompts share prefixes, and the exact block ids
    # below are those of the plain pool (test_prefix_caching.py covers the cache).
    return Scheduler(
        KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        **kw,
    )


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(
        request_id,
        list(range(1, num_prompt_tokens + 1)),
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
    )


def fake_step(scheduler: Scheduler, plan: SchedulerOutput, token: int = 7) -> list[str]:
    """Advance as a runner would; the scheduler finishes requests at max_tokens. Returns finished ids."""
    sampled = {item.request_id: token for item in plan.scheduled if item.needs_sample}
    updates = scheduler.update_from_output(plan, RunnerOutput(sampled=sampled))
    return [u.request.request_id for u in updates if u.request.status is RequestStatus.FINISHED_LENGTH]


def summary(plan: SchedulerOutput) -> list[tuple[str, int, int, list[int]]]:
    return [(s.request_id, s.start_position, len(s.token_ids), s.block_ids) for s in plan.scheduled]


def test_chunked_prefill_shares_budget_with_decodes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 3))
    plan = scheduler.schedule()
    assert summary(plan) == [("a", 0, 3, [0])]
    fake_step(scheduler, plan)
    scheduler.add_request(make_request("b", 20))
    plan = scheduler.schedule()
    # a decodes first; b gets the remaining 7 tokens of budget.
    assert summary(plan) == [("a", 3, 1, [0]), ("b", 0, 7, [1, 2])]
    assert plan.num_scheduled_tokens == 8
    assert not plan.scheduled[1].needs_sample
    fake_step(scheduler, plan)
    plan = scheduler.schedule()
    assert summary(plan) == [("a", 4, 1, [0, 3]), ("b", 7, 7, [1, 2, 4, 5])]


def test_preempts_newest_and_resumes_by_recompute() -> None:
    # 4 blocks of 2 slots: two requests of 3 prompt tokens take 2 blocks each.
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=16)
    scheduler.add_request(make_request("old", 3, max_tokens=6))
    scheduler.add_request(make_request("new", 3, max_tokens=6))
    plan = scheduler.schedule()
    assert summary(plan) == [("old", 0, 3, [0, 1]), ("new", 0, 3, [2, 3])]
    fake_step(scheduler, plan)
    plan = scheduler.schedule()  # both decode position 3: fits in their second blocks
    assert summary(plan) == [("old", 3, 1, [0, 1]), ("new", 3, 1, [2, 3])]
    fake_step(scheduler, plan)
    plan = scheduler.schedule()  # position 4 needs a new block each: "new" is preempted
    assert plan.preempted_request_ids == ["new"]
    assert summary(plan) == [("old", 4, 1, [0, 1, 2])]
    new = scheduler.requests["new"]
    assert (new.status, new.num_computed_tokens, new.num_output_tokens) == (RequestStatus.PREEMPTED, 0, 2)
    fake_step(scheduler, plan)
    # "old" runs to max_tokens=6, then "new" recomputes prompt + its 2 outputs.
    while "old" in scheduler.requests:
        plan = scheduler.schedule()
        fake_step(scheduler, plan)
    plan = scheduler.schedule()
    # "old" grew into block 3 and freed all four, in table order.
    assert summary(plan) == [("new", 0, 5, [0, 1, 2])]


def test_priority_policy_admits_lowest_value_first() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy=SchedulingPolicy.PRIORITY)
    scheduler.add_request(make_request("low", 2, priority=5))
    scheduler.add_request(make_request("urgent", 2, priority=-1))
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.scheduled] == ["urgent"]


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first", 2, priority=5))
    scheduler.add_request(make_request("second", 2, priority=-1))
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["first"]


def test_running_cap_and_no_chunking_when_disabled() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=10, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 8))
    scheduler.add_request(make_request("c", 1))
    plan = scheduler.schedule()
    # b does not fit whole in the 6 left: it waits, and so does c behind it (FCFS).
    assert [s.request_id for s in plan.scheduled] == ["a"]
    fake_step(scheduler, plan)
    plan = scheduler.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in plan.scheduled] == [("a", 1), ("b", 8)]
    fake_step(scheduler, plan)
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.scheduled] == ["a", "b"]  # running cap of 2 keeps c out


def test_abort_frees_blocks_of_running_and_waiting() -> None:
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("a", 8))
    scheduler.add_request(make_request("b", 8))
    scheduler.schedule()
    scheduler.add_request(make_request("c", 4))
    assert scheduler.kv_cache_manager.stats().num_used_blocks == 4
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("c", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.stats().num_used_blocks == 2
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.scheduled] == ["b"]
    assert sorted(plan.finished_request_ids) == ["a", "c"]


def test_request_alone_in_a_full_cache_finishes_with_length() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=2)
    scheduler.add_request(make_request("big", 4, max_tokens=10))
    fake_step(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    assert plan.capacity_finished_request_ids == ["big"]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.stats().num_free_blocks == 2


request_specs = st.lists(
    st.tuples(
        st.integers(1, 40),  # prompt tokens
        st.integers(1, 12),  # max tokens
        st.integers(0, 3),  # priority
        st.integers(0, 6),  # step at which it arrives
        st.booleans(),  # aborted mid-way
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=150, deadline=None)
@given(
    specs=request_specs,
    num_blocks=st.integers(14, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 48),
    policy=st.sampled_from(list(SchedulingPolicy)),
    chunked=st.booleans(),
    caching=st.booleans(),
)
def test_invariants_over_random_workloads(
    specs, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, policy, chunked, caching
) -> None:
    # Every request must fit alone, as the engine's admission check guarantees.
    specs = [s for s in specs if -(-(s[0] + s[1]) // block_size) <= num_blocks]
    scheduler = make_scheduler(
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        enable_chunked_prefill=chunked,
        policy=policy,
        enable_prefix_caching=caching,
    )
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    finished: set[str] = set()
    aborted_at: dict[str, int] = {}
    for step in range(5_000):
        for i, (prompt, max_tokens, priority, arrival, abort) in enumerate(specs):
            if arrival == step:
                scheduler.add_request(make_request(f"r{i}", prompt, max_tokens, priority))
                if abort:
                    aborted_at[f"r{i}"] = step + 2
        for request_id, when in aborted_at.items():
            if when == step and request_id in scheduler.requests:
                scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
                finished.add(request_id)
                assert manager.block_ids(request_id) == []
        plan = scheduler.schedule()
        finished.update(plan.capacity_finished_request_ids)
        # Budget and running cap.
        assert plan.num_scheduled_tokens == sum(len(s.token_ids) for s in plan.scheduled)
        assert plan.num_scheduled_tokens <= max_num_batched_tokens
        assert len(scheduler.running) <= max_num_seqs
        assert len({s.request_id for s in plan.scheduled}) == len(plan.scheduled)
        # No block twice in one table; free + used = total; a block's count is its number of
        # holders (1 each without caching); held blocks are not free.
        tables = [manager.block_ids(r.request_id) for r in scheduler.requests.values()]
        assert all(len(t) == len(set(t)) for t in tables)
        owned = [b for t in tables for b in t]
        assert pool.num_free_blocks + pool.num_used_blocks == num_blocks
        assert len(set(owned)) == pool.num_used_blocks
        assert all(pool.ref_count(b) == owned.count(b) for b in set(owned))
        assert caching or len(owned) == len(set(owned))
        for item in plan.scheduled:
            end = item.start_position + len(item.token_ids)
            assert len(item.block_ids) * block_size >= end
        finished.update(fake_step(scheduler, plan))
        if step > 6 and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests(), "some request never finished"
    assert finished == {f"r{i}" for i in range(len(specs))}
    assert pool.num_free_blocks == num_blocks


# -- token-level stops, applied as the scheduler takes a step's output ---------------------------


def run_tokens(scheduler: Scheduler, request: Request, tokens: list[int]) -> list:
    """Feed `tokens` to `request` one step each; the updates, until it finishes."""
    scheduler.add_request(request)
    updates = []
    for token in tokens:
        plan = scheduler.schedule()
        (update,) = scheduler.update_from_output(plan, RunnerOutput(sampled={request.request_id: token}))
        updates.append(update)
        if request.is_finished:
            break
    return updates


def test_eos_stops_only_after_min_tokens_and_hides_its_text() -> None:
    scheduler = make_scheduler(eos_token_ids=[2])
    request = Request("a", [5, 6], SamplingParams(max_tokens=8, min_tokens=2))
    updates = run_tokens(scheduler, request, [2, 9, 2, 9])
    assert [u.token_id for u in updates] == [2, 9, 2]
    assert [u.is_eos_stop for u in updates] == [False, False, True]
    assert (request.status, request.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    assert "a" not in scheduler.requests and scheduler.kv_cache_manager.stats().num_used_blocks == 0


def test_stop_token_ids_length_and_context() -> None:
    scheduler = make_scheduler(eos_token_ids=[2], max_model_len=5)
    stopped = Request("s", [5], SamplingParams(max_tokens=8, stop_token_ids=[11], ignore_eos=True))
    run_tokens(scheduler, stopped, [2, 11, 9])
    assert (stopped.output_token_ids, stopped.status, stopped.stop_reason) == (
        [2, 11],
        RequestStatus.FINISHED_STOPPED,
        11,
    )
    by_length = Request("l", [5], SamplingParams(max_tokens=2))
    run_tokens(scheduler, by_length, [9, 9, 9])
    assert (by_length.num_output_tokens, by_length.status) == (2, RequestStatus.FINISHED_LENGTH)
    by_context = Request("c", [5, 6, 7], SamplingParams(max_tokens=8))
    run_tokens(scheduler, by_context, [9, 9, 9])
    assert (by_context.num_tokens, by_context.status) == (5, RequestStatus.FINISHED_LENGTH)


def test_a_stop_string_turns_a_length_finish_into_a_stop() -> None:
    scheduler = make_scheduler()
    request = Request("a", [5], SamplingParams(max_tokens=1))
    run_tokens(scheduler, request, [9])
    assert request.status is RequestStatus.FINISHED_LENGTH
    scheduler.stop_at_string(request, "END")
    assert (request.status, request.stop_reason) == (RequestStatus.FINISHED_STOPPED, "END")
    running = Request("b", [5], SamplingParams(max_tokens=4))
    run_tokens(scheduler, running, [9])
    scheduler.stop_at_string(running, "END")
    assert running.status is RequestStatus.FINISHED_STOPPED and "b" not in scheduler.requests
