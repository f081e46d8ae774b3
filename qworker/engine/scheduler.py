from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from qworker.config import SchedulingPolicy
from qworker.engine.kv_cache_manager import CachedPrefix, KVCacheManager
from qworker.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute KV for `token_ids` at positions from `start_position`."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    # True when this chunk reaches the last known token, so the step samples the next one.
    needs_sample: bool


@dataclass
class SchedulerOutput:
    """The plan for one step. Plain data: the runner turns it into tensors."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left since the previous plan; the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Requests finished by the scheduler itself: alone in the cache, they could not grow.
    capacity_finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Iteration-level scheduler: decode first, then prefill chunks, preempt newest on OOM.

    Every step has a budget of `max_num_batched_tokens` and at most `max_num_seqs` running
    requests. Running requests are kept sorted by (priority, arrival), so the one to preempt
    when blocks run out is always the last: the newest under FCFS, the least urgent under the
    priority policy. Preemption is by recompute: blocks are freed and the request goes back to
    waiting with `num_computed_tokens = 0`; its generated tokens stay and are prefilled again.

    A waiting request (new or preempted) starts after its longest cached prefix, when prefix
    caching is on: those tokens count as computed and cost no budget. The blocks a plan's chunks
    fill are cached as the plan is made, so requests admitted in the same step share a prefix
    that the first of them computes in it, rather than each computing it.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.requests: dict[str, Request] = {}
        # heap of (sort key, request_id)
        self._waiting: list[tuple[tuple[int, int], str]] = []
        self.running: list[Request] = []
        self._finished_since_last_plan: list[str] = []
        self._next_arrival_index = 0
        self.num_preemptions = 0
        # Prompt tokens the model computed (prefix-cache hits excluded, recompute after
        # preemption included): the prefill work done.
        self.num_prompt_tokens_computed = 0

    # -- queue bookkeeping -------------------------------------------------------------------

    def _sort_key(self, request: Request) -> tuple[int, int]:
        priority = request.priority if self.policy is SchedulingPolicy.PRIORITY else 0
        return (priority, request.arrival_index)

    def add_request(self, request: Request, arrival_index: int | None = None) -> None:
        """Queue a request. `arrival_index` places it as if it had arrived then (a completion of
        an n > 1 request queued after its first one keeps that one's place); else it is last."""
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        if arrival_index is None:
            arrival_index = self._next_arrival_index
            self._next_arrival_index += 1
        request.arrival_index = arrival_index
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        heapq.heappush(self._waiting, (self._sort_key(request), request.request_id))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _peek_waiting(self) -> Request | None:
        # Aborted requests leave stale heap entries; skip them lazily.
        while self._waiting:
            request = self.requests.get(self._waiting[0][1])
            if request is not None and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                return request
            heapq.heappop(self._waiting)
        return None

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        heapq.heappush(self._waiting, (self._sort_key(request), request.request_id))

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        assert status.is_finished, f"{status} is not a finished status"
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = status
        self.kv_cache_manager.free(request_id)
        self._finished_since_last_plan.append(request_id)
        return request

    # -- the plan ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        manager = self.kv_cache_manager

        def take(request: Request, num_new_tokens: int, block_ids: list[int]) -> None:
            start = request.num_computed_tokens
            end = start + num_new_tokens
            if start < request.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(end, request.num_prompt_tokens) - start
            scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.token_ids[start:end],
                    start_position=start,
                    block_ids=list(block_ids),
                    needs_sample=end == request.num_tokens,
                )
            )
            # Requests admitted after this one in the same plan can share what it computes.
            manager.cache_scheduled_blocks(request, end)

        # 1. Decodes of running requests, oldest first; preempt from the back when blocks run out.
        # A request past its prompt may have more than one token to compute: tokens a grammar
        # forced (fast-forward) are computed here too, so that they can preempt like a decode.
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        decode_ids = {id(r) for r in decoding}
        scheduled_ids: set[int] = set()
        capacity_finished: list[str] = []
        for request in decoding:
            if token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while True:
                block_ids = manager.allocate_slots(request, num_new_tokens)
                if block_ids is not None:
                    take(request, num_new_tokens, block_ids)
                    scheduled_ids.add(id(request))
                    token_budget -= num_new_tokens
                    break
                if len(self.running) == 1:
                    # It holds the whole pool and still cannot grow: waiting would not help.
                    request.stop_reason = "kv_cache_full"
                    self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
                    capacity_finished.append(request.request_id)
                    break
                victim = self.running[-1]
                if id(victim) in scheduled_ids:
                    # Everything behind this request is already scheduled: it must wait itself.
                    victim = request
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break

        # 2. Prefill chunks of running requests (chunked prefill in progress). No preemption here:
        # a chunk that does not fit simply waits for a later step.
        for request in list(self.running):
            if token_budget == 0:
                break
            if id(request) in decode_ids:
                continue
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            block_ids = manager.allocate_slots(request, num_new_tokens)
            if block_ids is None:
                continue
            take(request, num_new_tokens, block_ids)
            token_budget -= num_new_tokens

        # 3. Admit waiting requests, best first, while budget, the running cap and blocks allow.
        # After a preemption nothing new joins this step: the pool is already short.
        while token_budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self._peek_waiting()
            if request is None:
                break
            # Cached tokens produce no logits: a request scoring its prompt computes all of it.
            if request.sampling_params.prompt_logprobs is not None:
                cached_prefix = CachedPrefix()
            else:
                cached_prefix = manager.find_cached_prefix(request)
            num_remaining = request.num_tokens - cached_prefix.num_tokens
            num_new_tokens = min(num_remaining, token_budget)
            if (
                not self.enable_chunked_prefill
                and num_new_tokens < num_remaining
                and token_budget < self.max_num_batched_tokens
            ):
                break  # wait for a step with the whole budget free
            block_ids = manager.allocate_slots(request, num_new_tokens, cached_prefix)
            if block_ids is None:
                break
            heapq.heappop(self._waiting)
            request.num_computed_tokens = cached_prefix.num_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._sort_key)
            take(request, num_new_tokens, block_ids)
            token_budget -= num_new_tokens

        finished = self._finished_since_last_plan
        self._finished_since_last_plan = []
        num_scheduled_tokens = self.max_num_batched_tokens - token_budget
        return SchedulerOutput(scheduled, num_scheduled_tokens, preempted, finished, capacity_finished)

    def update_from_output(self, plan: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance the counters of every scheduled request, cache the blocks the step filled,
        and append the sampled tokens."""
        self.kv_cache_manager.commit_scheduled()
        for item in plan.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:
                continue  # aborted while the step ran
            request.num_computed_tokens = item.start_position + len(item.token_ids)
            self.kv_cache_manager.cache_blocks(request)
            token_id = sampled.get(item.request_id)
            if token_id is not None:
                request.append_output_token(token_id)
