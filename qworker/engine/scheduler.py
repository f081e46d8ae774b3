from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING

from qworker.config import SchedulingPolicy
from qworker.engine.kv_cache_manager import CachedPrefix, KVCacheManager
from qworker.engine.request import Request, RequestStatus
from qworker.engine.runner_output import RunnerOutput
from qworker.engine.scheduler_output import (
    GrammarRows,
    NewRequestData,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from qworker.engine.structured.state import consume, fill_masks

if TYPE_CHECKING:
    from qworker.lora.manager import LoRAManager

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]

# Pooling requests looked at together for packing (the waiting queue's head, at most this many).
MAX_PACKING_WINDOW = 1024


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

    The scheduler is the only code that changes a Request. Taking a step's output
    (`update_from_output`) appends the sampled tokens, advances the grammars and applies the
    token-level stop rules (`eos_token_ids`, stop_token_ids, a complete grammar, max_tokens and
    `max_model_len`, None for no context limit); the output processor applies stop strings
    through `stop_at_string`.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        *,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        # LoRA adapters' device slots, counted as blocks are: a waiting request whose adapter
        # has no slot now is passed over, and requests behind it that can run start.
        self.lora = lora
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
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
        # Requests here with a grammar: while there are none, a plan looks for no masks.
        self._num_constrained = 0
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
        if request.grammar is not None:
            self._num_constrained += 1
        if request.lora_request is not None and self.lora is not None:
            self.lora.pin(request.lora_request.lora_int_id)
        heapq.heappush(self._waiting, (self._sort_key(request), request.request_id))

    def take_arrival_index(self) -> int:
        """The next arrival index, for a request that joins later but keeps its place (one that
        waited for its LoRA adapter to load)."""
        arrival_index = self._next_arrival_index
        self._next_arrival_index += 1
        return arrival_index

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
        if request.lora_request is not None and self.lora is not None:
            self.lora.release(request.lora_request.lora_int_id)
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
            if request.lora_request is not None and self.lora is not None:
                self.lora.release(request.lora_request.lora_int_id)
        if request.lora_request is not None and self.lora is not None:
            self.lora.unpin(request.lora_request.lora_int_id)
        request.status = status
        if request.grammar is not None:
            self._num_constrained -= 1
        self.kv_cache_manager.free(request_id)
        self._finished_since_last_plan.append(request_id)
        return request

    # -- the plan ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequestData] = []
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
                    # A pooling request samples nothing: the runner pools its last chunk.
                    needs_sample=end == request.num_tokens and request.pooling is None,
                    num_tokens=request.num_tokens,
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
        lora_loads: list[tuple[int, object]] = []
        passed_over: list[tuple[tuple[int, int], str]] = []  # waiting for a LoRA slot
        # Pooling requests taken off the heap to pack this step, in the order to admit them.
        packing: list[tuple[tuple[int, int], str]] = []
        while token_budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            candidate = self.requests[packing[0][1]] if packing else self._peek_waiting()
            if candidate is None:
                break
            request = candidate
            lora = request.lora_request
            if lora is not None and self.lora is not None and not self.lora.can_acquire(lora.lora_int_id):
                passed_over.append(heapq.heappop(self._waiting))
                continue
            # Cached tokens produce no logits: a request scoring its prompt computes all of it,
            # and so does a pooling request that pools more than its last token (mean, CLS).
            if request.sampling_params.prompt_logprobs is not None or (
                request.pooling is not None and request.pooling.needs_every_position(request.num_tokens)
            ):
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
            if packing:
                packing.pop(0)
            else:
                heapq.heappop(self._waiting)
            lora_slot = -1
            if lora is not None and self.lora is not None:
                lora_slot, load = self.lora.acquire(lora.lora_int_id)
                if load is not None:
                    lora_loads.append((lora_slot, load))
            request.num_computed_tokens = cached_prefix.num_tokens
            if request.num_cached_tokens < 0:  # the first scheduling's hit, not a resume's
                request.num_cached_tokens = cached_prefix.num_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._sort_key)
            new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    token_ids=list(request.token_ids),
                    sampling_params=request.sampling_params,
                    num_scored_prompt_tokens=len(request.prompt_logprobs),
                    num_resumed_tokens=request.num_resumed_tokens,
                    lora_slot=lora_slot,
                    bad_words_token_ids=request.bad_words_token_ids,
                    pooling=request.pooling,
                )
            )
            take(request, num_new_tokens, block_ids)
            token_budget -= num_new_tokens
            if request.pooling is not None and not packing and token_budget > 0:
                packing = self._pooling_to_pack(token_budget)
        for entry in (*passed_over, *packing):
            heapq.heappush(self._waiting, entry)

        finished = self._finished_since_last_plan
        self._finished_since_last_plan = []
        num_scheduled_tokens = self.max_num_batched_tokens - token_budget
        return SchedulerOutput(
            scheduled,
            num_scheduled_tokens,
            new_requests,
            preempted,
            finished,
            capacity_finished,
            self._grammar_rows(scheduled),
            lora_loads,
        )

    def _pooling_to_pack(self, token_budget: int) -> list[tuple[tuple[int, int], str]]:
        """Packing: the pooling requests waiting at the head of the queue (up to the first request
        that is not one, so that FCFS holds between pooling and generation), taken off the heap in
        the order to admit them: the shortest first while their whole prompts fit in the budget
        (more requests in fewer, fuller steps), then the others oldest first (the next one takes
        the rest of the budget as a chunk). The caller pushes back those it does not admit."""
        window: list[tuple[tuple[int, int], str]] = []
        room = min(self.max_num_seqs - len(self.running), MAX_PACKING_WINDOW)
        while self._waiting and len(window) < room:
            request_id = self._waiting[0][1]
            request = self.requests.get(request_id)
            if request is None or request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                heapq.heappop(self._waiting)  # aborted: a stale entry
                continue
            if request.pooling is None or request.lora_request is not None:
                break
            window.append(heapq.heappop(self._waiting))
        by_length = sorted(window, key=lambda entry: (self.requests[entry[1]].num_tokens, entry[0]))
        packed: list[tuple[tuple[int, int], str]] = []
        for entry in by_length:
            num_tokens = self.requests[entry[1]].num_tokens
            if num_tokens > token_budget:
                break
            packed.append(entry)
            token_budget -= num_tokens
        taken = set(packed)
        return [*packed, *(entry for entry in window if entry not in taken)]

    def _grammar_rows(self, scheduled: list[ScheduledRequest]) -> GrammarRows | None:
        """The masks of the constrained requests among those the step samples."""
        if self._num_constrained == 0:
            return None
        states = []
        request_ids = []
        for item in scheduled:
            if not item.needs_sample:
                continue
            request = self.requests[item.request_id]
            if request.grammar is None:
                continue
            assert request.grammar.num_tokens == request.num_output_tokens, (
                f"request {request.request_id}: matcher at {request.grammar.num_tokens} tokens, "
                f"request at {request.num_output_tokens}"
            )
            states.append(request.grammar)
            request_ids.append(item.request_id)
        if not states:
            return None
        return GrammarRows(request_ids, fill_masks(states))

    # -- taking a step's output --------------------------------------------------------------

    def update_from_output(self, plan: SchedulerOutput, output: RunnerOutput) -> list[RequestUpdate]:
        """Advance the counters of every scheduled request, cache the blocks the step filled,
        append the sampled tokens (and their logprobs), advance the grammars, and finish the
        requests a token-level stop rule ends. One update per sampled token, in sampling order."""
        self.kv_cache_manager.commit_scheduled()
        for request_id, scored in output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.prompt_logprobs.extend(scored)
        sampled: list[tuple[Request, int]] = []
        for item in plan.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:
                continue  # aborted while the step ran
            request.num_computed_tokens = item.start_position + len(item.token_ids)
            self.kv_cache_manager.cache_blocks(request)
        for request_id in output.pooled:
            # Prefill only: done at its last chunk, its blocks freed at once.
            self.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        for request_id, token_id in output.sampled.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.append_output_token(token_id)
            token_logprobs = output.logprobs.get(request_id)
            if token_logprobs is not None:
                request.logprobs.append(token_logprobs)
            sampled.append((request, token_id))
        consume([(request.grammar, token_id) for request, token_id in sampled if request.grammar is not None])
        return [self._check_stop(request, token_id) for request, token_id in sampled]

    def append_forced_tokens(self, forced: list[tuple[Request, int]]) -> list[RequestUpdate]:
        """Append tokens that the requests' grammars force (fast-forward: no sampling), with the
        same stop rules as sampled tokens. The next plan computes them as a chunk."""
        consume([(request.grammar, token_id) for request, token_id in forced if request.grammar is not None])
        updates = []
        for request, token_id in forced:
            assert self.requests.get(request.request_id) is request, f"{request.request_id} is not running"
            request.append_output_token(token_id)
            updates.append(self._check_stop(request, token_id))
        return updates

    def _check_stop(self, request: Request, token_id: int) -> RequestUpdate:
        """vLLM's check_stop: end the request if the token it just took is a stop."""
        params = request.sampling_params
        status: RequestStatus | None = None
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        num_output_tokens = len(request.output_token_ids)
        if num_output_tokens >= params.min_tokens:
            if is_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
        grammar_error = None
        grammar = request.grammar
        if grammar is not None and status is None:
            if grammar.error is not None:
                status = RequestStatus.FINISHED_ABORTED
                grammar_error = grammar.error
            elif grammar.is_stopped:
                # The grammar is complete: nothing else may follow, so stop without an EOS.
                status = RequestStatus.FINISHED_STOPPED
        if status is None and num_output_tokens >= params.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is None and self.max_model_len is not None and request.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish_request(request.request_id, status)
        return RequestUpdate(
            request, token_id, status is RequestStatus.FINISHED_STOPPED and is_eos, grammar_error
        )

    def stop_at_string(self, request: Request, stop: str) -> None:
        """A stop string ends the request's text: it stops now, with finish reason "stop" even
        when the same token also reached a length limit (and finished it already)."""
        request.stop_reason = stop
        if self.requests.get(request.request_id) is request:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        else:
            assert request.is_finished, f"request {request.request_id} is neither running nor finished"
            request.status = RequestStatus.FINISHED_STOPPED
