"""Requests with n > 1 (vLLM's parallel sampling): each completion runs as a child request
`{id}#{i}` sharing the prompt, and the children's outputs are routed back to the parent's id.

Child 0 is queued first; the others join once its prompt is computed, so that with prefix caching
they find the prompt's full blocks in the cache instead of computing them again. The engine queues
children (it owns the request states); this module owns which child belongs to which parent, what
the parent's streamed and final outputs are, and when the waiting children may join.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from qworker.engine.outputs import RequestOutput, StepOutput
from qworker.engine.request import Request
from qworker.engine.sampling_params import SamplingParams


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class ParentRequest:
    """A request with n > 1, as its children see it."""

    request_id: str
    child_ids: list[str]
    # Children not yet queued: (child id, its params), added after child 0's prefill.
    pending: list[tuple[str, SamplingParams]]
    prompt: str | None
    token_ids: list[int]
    priority: int
    arrival_time: float
    # completion index -> the child's final (or, after an abort, partial) output
    outputs: dict[int, RequestOutput] = field(default_factory=dict)

    @property
    def first_child_id(self) -> str:
        return self.child_ids[0]

    @property
    def is_done(self) -> bool:
        return len(self.outputs) == len(self.child_ids)

    def take_pending(self) -> list[tuple[str, SamplingParams]]:
        pending, self.pending = self.pending, []
        return pending

    def output(self) -> RequestOutput:
        """The parent's output: the children's completions so far, in index order."""
        indices = sorted(self.outputs)
        first = self.outputs[indices[0]]
        completions = []
        for i in indices:
            completion = self.outputs[i].outputs[0]
            completion.index = i
            completions.append(completion)
        finished_times = [o.metrics.finished_time for o in self.outputs.values() if o.metrics.finished_time]
        metrics = replace(first.metrics, finished_time=max(finished_times) if finished_times else None)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.token_ids,
            outputs=completions,
            finished=all(o.finished for o in self.outputs.values()),
            metrics=metrics,
            num_preemptions=sum(o.num_preemptions for o in self.outputs.values()),
            # The prompt once, as prompt_tokens counts it: completion 0 computes it, and the
            # others then take its blocks from the cache.
            num_cached_tokens=self.outputs.get(0, first).num_cached_tokens,
            prompt_logprobs=self.outputs[0].prompt_logprobs if 0 in self.outputs else None,
        )


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s own params: one sample, its own seed; the prompt is scored once, by
    completion 0."""
    return replace(
        params,
        n=1,
        seed=params.child_seed(index),
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


class ParallelSampling:
    """The engine's n > 1 requests: parents by id, and each child's parent and index."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        # child request id -> (parent id, completion index)
        self._children: dict[str, tuple[str, int]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._parents or request_id in self._children

    def has_parents(self) -> bool:
        return bool(self._parents)

    def has_children(self) -> bool:
        return bool(self._children)

    def has_pending_children(self) -> bool:
        return any(p.pending for p in self._parents.values())

    def add(
        self,
        request_id: str,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float,
    ) -> ParentRequest:
        """Register a parent and its params.n children; every child but the first is pending."""
        assert params.n > 1, f"request {request_id}: parallel sampling is for n > 1, got n={params.n}"
        assert request_id not in self, f"request id {request_id!r} is already registered"
        children = [(child_id(request_id, i), child_params(params, i)) for i in range(params.n)]
        parent = ParentRequest(
            request_id,
            [cid for cid, _ in children],
            children[1:],
            prompt,
            token_ids,
            priority,
            arrival_time,
        )
        self._parents[request_id] = parent
        for index, cid in enumerate(parent.child_ids):
            self._children[cid] = (request_id, index)
        return parent

    def pop(self, request_id: str) -> ParentRequest | None:
        """Forget a parent (its abort): its children are no longer routed, none is left pending."""
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            parent.pending = []
            for cid in parent.child_ids:
                self._children.pop(cid, None)
        return parent

    def scheduler_id(self, request_id: str) -> str:
        """The id the scheduler knows for a request: child 0's for a parent, else its own."""
        return child_id(request_id, 0) if request_id in self._parents else request_id

    def caller_id(self, request_id: str) -> str:
        """The id the caller knows for a scheduled request: its parent's for a child."""
        link = self._children.get(request_id)
        return link[0] if link is not None else request_id

    def prefilled(self, requests: Mapping[str, Request]) -> Iterator[ParentRequest]:
        """Parents with children pending whose child 0 has computed its prompt (or is gone)."""
        for parent in self._parents.values():
            if not parent.pending:
                continue
            first = requests.get(parent.first_child_id)
            if first is None or first.num_output_tokens > 0:
                yield parent

    def route(self, out: StepOutput) -> StepOutput | None:
        """A step output as the caller sees it: a child's becomes its parent's (the deltas of
        completion 0, then one finished output once every completion has finished); None for the
        other children's deltas. Outputs of plain requests pass unchanged."""
        link = self._children.get(out.request_id)
        if link is None:
            return out
        parent_id, index = link
        parent = self._parents[parent_id]
        if out.finished:
            assert out.output is not None, f"finished child {out.request_id} has no output"
            parent.outputs[index] = out.output
            del self._children[out.request_id]
        if parent.is_done:
            del self._parents[parent_id]
            output = parent.output()
            delta = out.text_delta if index == 0 else ""
            tokens = out.new_token_ids if index == 0 else []
            return StepOutput(parent_id, tokens, delta, True, output.outputs[0].finish_reason, output)
        if index != 0:
            return None
        return StepOutput(parent_id, out.new_token_ids, out.text_delta, False)
