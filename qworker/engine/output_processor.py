"""What the engine hands back per request (vLLM v1's `v1/engine/output_processor.py`): text
deltas from an incremental detokenizer, stop strings, logprob dictionaries, the fan-in of n > 1
requests into their parent, and grammar fast-forward. It reads requests and never changes them:
the stops it finds (a stop string) and the tokens it forces go through the scheduler."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from qworker.engine.detokenizer import IncrementalDetokenizer
from qworker.engine.outputs import (
    CompletionOutput,
    Logprob,
    LogprobsDict,
    RequestError,
    RequestMetrics,
    RequestOutput,
    StepOutput,
)
from qworker.engine.parallel_sampling import ParallelSampling
from qworker.engine.request import Request
from qworker.engine.sampler import PositionLogprobs
from qworker.engine.scheduler import Scheduler
from qworker.engine.scheduler_output import RequestUpdate, SchedulerOutput
from qworker.engine.structured.manager import MAX_FAST_FORWARD_TOKENS, StructuredOutputManager
from qworker.engine.structured.state import GrammarState, forced_tokens
from qworker.errors import ResumeRefusedError

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """The output side of one request in the scheduler: its text and timestamps."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    error: RequestError | None = None


class OutputProcessor:
    """Turns the scheduler's per-token updates into StepOutputs, request by request.

    `parallel` holds the n > 1 parents: their children are requests of their own here and in the
    scheduler, and `route` folds the children's outputs into their parent's.
    """

    def __init__(self, tokenizer: Any, structured: StructuredOutputManager) -> None:
        self.tokenizer = tokenizer
        self.structured = structured
        self.parallel = ParallelSampling()
        self._states: dict[str, RequestState] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states

    def add_request(
        self, request: Request, prompt: str | None, arrival_time: float, resumed_text: str | None = None
    ) -> None:
        """Take a new request. A resumed one (output tokens given at creation) has them decoded
        first, as its earlier run decoded them, so that its next delta continues the text that
        run streamed (`resumed_text`, checked when given). Raises ResumeRefusedError when a stop
        string lies among them or the text differs."""
        assert request.request_id not in self._states, f"request {request.request_id} is already here"
        detokenizer = None
        if self.tokenizer is not None:
            params = request.sampling_params
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            if request.num_resumed_tokens:
                _replay(detokenizer, request, resumed_text)
        self._states[request.request_id] = RequestState(
            request, prompt, detokenizer, RequestMetrics(arrival_time)
        )

    def arrival_index(self, request_id: str) -> int | None:
        state = self._states.get(request_id)
        return state.request.arrival_index if state is not None else None

    def mark_scheduled(self, plan: SchedulerOutput, now: float) -> None:
        for item in plan.scheduled:
            state = self._states.get(item.request_id)
            if state is None:
                continue  # a pooling request: the engine keeps its own (engine/pooling_requests.py)
            metrics = state.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    # -- one step's tokens -------------------------------------------------------------------

    def process(self, updates: list[RequestUpdate], scheduler: Scheduler, now: float) -> list[StepOutput]:
        """One StepOutput per update, in order; a stop string ends its request through the
        scheduler. Then the tokens the grammars force join their requests' outputs."""
        outputs = []
        constrained: list[tuple[Request, StepOutput]] = []
        for update in updates:
            step_output = self._process_update(update, scheduler, now)
            outputs.append(step_output)
            request = update.request
            # A forced token has no logits of its own: requests asking logprobs sample every token.
            if (
                request.grammar is not None
                and not step_output.finished
                and request.sampling_params.logprobs is None
            ):
                constrained.append((request, step_output))
        if constrained and self.structured.enable_fast_forward:
            self._fast_forward(constrained, scheduler, now)
        return outputs

    def _process_update(self, update: RequestUpdate, scheduler: Scheduler, now: float) -> StepOutput:
        request = update.request
        state = self._states[request.request_id]
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        if update.grammar_error is not None:
            state.error = RequestError("StructuredOutputError", update.grammar_error)
        detokenizer = state.detokenizer
        if detokenizer is not None and not update.is_eos_stop:
            stop_string = detokenizer.update(update.token_id)
            if stop_string is not None and request.num_output_tokens >= request.sampling_params.min_tokens:
                scheduler.stop_at_string(request, stop_string)
        finished = request.is_finished
        delta = detokenizer.take_delta(finished) if detokenizer is not None else ""
        step_output = StepOutput(request.request_id, [update.token_id], delta, finished)
        if finished:
            state.metrics.finished_time = now
            del self._states[request.request_id]
            step_output.finish_reason = request.status.finish_reason
            step_output.output = self._make_output(state)
        return step_output

    def _fast_forward(
        self, constrained: list[tuple[Request, StepOutput]], scheduler: Scheduler, now: float
    ) -> None:
        """Where a grammar allows exactly one next token, append it without sampling: masked
        decoding could pick nothing else. The next step computes these tokens as a prefill chunk.
        Each forced token passes the same end checks as a sampled one (max_tokens, stop strings,
        the context), and joins its request's step output."""
        live = constrained
        for _ in range(MAX_FAST_FORWARD_TOKENS):
            grammars: list[GrammarState] = [request.grammar for request, _ in live]  # type: ignore[misc]
            tokens = forced_tokens(grammars)
            forced = [(item, token) for item, token in zip(live, tokens, strict=True) if token is not None]
            if not forced:
                return
            updates = scheduler.append_forced_tokens([(request, token) for (request, _), token in forced])
            self.structured.num_fast_forward_tokens += len(updates)
            live = []
            for ((request, step_output), _), update in zip(forced, updates, strict=True):
                more = self._process_update(update, scheduler, now)
                step_output.new_token_ids.extend(more.new_token_ids)
                step_output.text_delta += more.text_delta
                if more.finished:
                    step_output.finished = True
                    step_output.finish_reason = more.finish_reason
                    step_output.output = more.output
                else:
                    live.append((request, step_output))
            if not live:
                return

    # -- ends the scheduler decided ----------------------------------------------------------

    def finish_capacity(self, request_id: str, now: float) -> StepOutput:
        """The scheduler stopped the request: alone, it fills the KV cache."""
        state = self._states.pop(request_id)
        state.metrics.finished_time = now
        logger.warning("request %s stopped: it alone fills the KV cache", request_id)
        delta = state.detokenizer.take_delta(True) if state.detokenizer is not None else ""
        return StepOutput(request_id, [], delta, True, "length", self._make_output(state))

    def finish_aborted(self, request_id: str, now: float) -> RequestOutput:
        """The request was aborted (the scheduler has finished it): its partial output."""
        state = self._states.pop(request_id)
        state.metrics.finished_time = now
        return self._make_output(state)

    def failed_before_start(self, request_id: str, error: Exception, now: float) -> StepOutput:
        """A request that never reached the scheduler (its grammar did not compile): finished,
        failed, with nothing generated."""
        output = RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=[],
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason=None)],
            finished=True,
            metrics=RequestMetrics(now, finished_time=now),
            error=RequestError(type(error).__name__, str(error)),
        )
        return StepOutput(request_id, [], "", True, None, output)

    def route(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """The outputs as the caller sees them: n > 1 children folded into their parents."""
        if not self.parallel.has_children():
            return outputs
        return [routed for out in outputs if (routed := self.parallel.route(out)) is not None]

    # -- results -----------------------------------------------------------------------------

    def _make_output(self, state: RequestState) -> RequestOutput:
        request = state.request
        text = state.detokenizer.output_text if state.detokenizer is not None else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        params = request.sampling_params
        if params.logprobs is not None:
            completion.logprobs = [self._logprobs_dict(p) for p in request.logprobs]
        prompt_logprobs: list[LogprobsDict | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None, *(self._logprobs_dict(p) for p in request.prompt_logprobs)]
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            metrics=state.metrics,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=min(max(request.num_cached_tokens, 0), request.num_prompt_tokens),
            prompt_logprobs=prompt_logprobs,
            error=state.error,
        )

    def _logprobs_dict(self, position: PositionLogprobs) -> LogprobsDict:
        """vLLM's shape: the chosen token first, then the top-k alternatives by rank."""
        ids = [position.token_id, *position.top_token_ids]
        texts: list[str | None] = [None] * len(ids)
        if self.tokenizer is not None:
            texts = list(self.tokenizer.batch_decode([[t] for t in ids]))
        result: LogprobsDict = {position.token_id: Logprob(position.logprob, position.rank, texts[0])}
        for rank, (token_id, logprob, text) in enumerate(
            zip(position.top_token_ids, position.top_logprobs, texts[1:], strict=True), start=1
        ):
            result.setdefault(token_id, Logprob(logprob, rank, text))
        return result


def _replay(detokenizer: IncrementalDetokenizer, request: Request, resumed_text: str | None) -> None:
    """Decode a resumed request's earlier tokens, emitting their text as its earlier run did (the
    held-back tail of a stop string's start or a partial character stays held back)."""
    min_tokens = request.sampling_params.min_tokens
    for i, token_id in enumerate(request.output_token_ids):
        stop = detokenizer.update(token_id)
        if stop is not None and i + 1 >= min_tokens:
            raise ResumeRefusedError(f"stop string {stop!r} ends the stored tokens: the run ended there")
    streamed = detokenizer.take_delta(False)
    if resumed_text is not None and streamed != resumed_text:
        raise ResumeRefusedError(
            f"the stored text ({len(resumed_text)} characters) is not what its {request.num_resumed_tokens} "
            f"stored tokens decode to ({len(streamed)} characters)"
        )
