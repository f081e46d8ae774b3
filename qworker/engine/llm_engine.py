from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qworker.config import EngineConfig
from qworker.engine.block_pool import KVCacheStats
from qworker.engine.detokenizer import IncrementalDetokenizer
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.outputs import (
    CompletionOutput,
    Logprob,
    LogprobsDict,
    RequestError,
    RequestMetrics,
    RequestOutput,
    StepOutput,
)
from qworker.engine.parallel_sampling import ParallelSampling, ParentRequest, child_id, child_params
from qworker.engine.request import Request, RequestStatus
from qworker.engine.runner import ModelRunner
from qworker.engine.sampler import PositionLogprobs
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler import Scheduler
from qworker.engine.structured import StructuredOutputs
from qworker.engine.structured.manager import MAX_FAST_FORWARD_TOKENS, StructuredOutputManager
from qworker.engine.structured.state import GrammarState, consume, forced_tokens
from qworker.engine.structured.tool_calls import template_messages
from qworker.errors import EngineStepError, InvalidRequestError, PromptTooLongError
from qworker.model.loader import load_hf_config, load_state_dict, load_tokenizer, resolve_model
from qworker.model.registry import model_config_from_hf
from qworker.utils import cdiv

__all__ = ["LLMEngine", "Prompt"]

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any] | Sequence[int]


@dataclass
class _RequestState:
    """Engine-side bookkeeping next to the core Request: text and timestamps."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    error: RequestError | None = None


class LLMEngine:
    """The engine core: add requests, step, read streamed outputs. Knows nothing of queues.

    The weights, the KV cache tensors and the device live in `runner`; the engine keeps the
    tokenizer, the request states and the scheduler.
    """

    def __init__(
        self, config: EngineConfig, *, hf_config: Any = None, state_dict: Any = None, tokenizer: Any = None
    ) -> None:
        self.config = config
        started = time.perf_counter()
        if hf_config is None:
            resolved = resolve_model(config.model)
            hf_config = load_hf_config(resolved.path)
            tokenizer = load_tokenizer(resolved.path)
            state_dict = load_state_dict(resolved.path)
        self.tokenizer = tokenizer
        self.model_config = model_config_from_hf(hf_config)
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.runner = ModelRunner(
            config,
            self.model_config,
            self.max_model_len,
            state_dict=state_dict,
            eos_token_ids=self.eos_token_ids,
        )
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching and self.model_config.is_prefix_cacheable,
            # What decides a block's KV besides its tokens: this engine's weights and dtype.
            cache_salt=f"{config.model}|{self.runner.dtype}",
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
        )
        self._states: dict[str, _RequestState] = {}
        # n > 1 requests: their children are requests of their own in _states and the scheduler.
        self._parallel = ParallelSampling()
        # Grammars of structured-output requests; such a request waits there until it compiles.
        self.structured = StructuredOutputManager(
            tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
        )
        self.num_steps = 0
        self.startup_seconds = time.perf_counter() - started
        logger.info(
            "engine ready in %.1fs: %s on %s/%s, %d KV blocks of %d, backend %s",
            self.startup_seconds,
            config.model,
            self.device,
            self.dtype,
            self.num_kv_blocks,
            config.block_size,
            self.attention_backend_name,
        )

    # -- what the runner chose ---------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def attention_backend_name(self) -> str:
        return self.runner.backend.name

    def _max_model_len(self) -> int:
        mc = self.model_config
        limit = mc.max_position_embeddings
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's {limit}")
            limit = self.config.max_model_len
        return limit

    # -- requests ----------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise InvalidRequestError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise InvalidRequestError(
            f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt)}"
        )

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not messages:
            raise InvalidRequestError("messages is empty")
        messages = template_messages(messages, self.tokenizer.chat_template or "")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def validate_prompt_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; the model's context is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)"
            )
        blocks = cdiv(len(token_ids) + 1, self.config.block_size)
        if blocks > self.num_kv_blocks:
            raise PromptTooLongError(
                f"prompt of {len(token_ids)} tokens needs {blocks} KV blocks; "
                f"the cache holds {self.num_kv_blocks}"
            )
        if not self.config.enable_chunked_prefill and len(token_ids) > self.config.max_num_batched_tokens:
            raise PromptTooLongError(
                f"prompt of {len(token_ids)} tokens exceeds max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) with chunked prefill disabled"
            )

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request. Raises a typed InvalidRequestError subclass for bad input.

        With `params.n > 1` the request runs as n child requests sharing the prompt's KV blocks;
        its step outputs carry the parent id (text deltas of completion 0) and its final output
        holds the n completions.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id or uuid.uuid4().hex
        if (
            request_id in self._states
            or request_id in self._parallel
            or request_id in self.structured.waiting
        ):
            raise InvalidRequestError(f"request id {request_id!r} is already in the engine")
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt_token_ids(token_ids)
        params.check_model_limits(self.model_config.vocab_size)
        if params.n > 1 and any(child_id(request_id, i) in self._states for i in range(params.n)):
            raise InvalidRequestError(f"request id {request_id!r} clashes with a request in the engine")
        arrival_time = arrival_time or time.time()
        if params.structured_outputs is not None:
            # Compiles off this thread; the request joins the scheduler at a later step.
            self.structured.wait_for_grammar(
                request_id,
                StructuredOutputs.from_value(params.structured_outputs),
                lambda: self._start(request_id, text, token_ids, params, priority, arrival_time),
            )
            return request_id
        self._start(request_id, text, token_ids, params, priority, arrival_time)
        return request_id

    def _start(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float,
    ) -> None:
        if params.n == 1:
            self._enqueue(request_id, text, token_ids, params, priority, arrival_time)
            return
        parent = self._parallel.add(request_id, text, token_ids, params, priority, arrival_time)
        self._enqueue(
            parent.first_child_id, text, token_ids, child_params(params, 0), priority, parent.arrival_time
        )
        if not self.config.enable_prefix_caching:
            self._release_children(parent)

    def _release_children(self, parent: ParentRequest) -> None:
        # The others queue in completion 0's place, not behind requests that came after it.
        first = self._states.get(parent.first_child_id)
        arrival_index = first.request.arrival_index if first is not None else None
        for cid, params in parent.take_pending():
            self._enqueue(
                cid,
                parent.prompt,
                parent.token_ids,
                params,
                parent.priority,
                parent.arrival_time,
                arrival_index,
            )

    def _enqueue(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float,
        arrival_index: int | None = None,
    ) -> None:
        request = Request(request_id, token_ids, params, priority=priority)
        if params.structured_outputs is not None:
            request.grammar = self.structured.new_state(
                StructuredOutputs.from_value(params.structured_outputs)
            )
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
        self._states[request_id] = _RequestState(request, text, detokenizer, RequestMetrics(arrival_time))
        self.scheduler.add_request(request, arrival_index)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a queued or running request now and free its blocks. Returns its partial output."""
        if self.structured.waiting.pop(request_id, None) is not None:
            return None  # its grammar was still compiling: nothing ran
        parent = self._parallel.pop(request_id)
        if parent is not None:
            for index, cid in enumerate(parent.child_ids):
                child_output = self.abort(cid)
                if child_output is not None:
                    parent.outputs[index] = child_output
            return parent.output() if parent.outputs else None
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        state.metrics.finished_time = time.time()
        return self._make_output(state)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._parallel.has_pending_children()
            or bool(self.structured.waiting)
        )

    def kv_stats(self) -> KVCacheStats:
        return self.kv_cache_manager.stats()

    def num_cached_prefix_tokens(self, request_id: str) -> int:
        """Leading tokens of a queued request that it would share from the prefix cache without
        taking a free block: those in cached blocks that requests hold now. 0 for an unknown
        request or with prefix caching off. Changes nothing."""
        request = self.scheduler.requests.get(self._parallel.scheduler_id(request_id))
        if request is None:
            return 0
        return self.kv_cache_manager.num_shared_prefix_tokens(request)

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Schedule, run the model once, and return each request's new tokens and text."""
        failed = self._start_compiled()
        self._release_prefilled_children()
        plan = self.scheduler.schedule()
        outputs = [self._finish_capacity(request_id) for request_id in plan.capacity_finished_request_ids]
        if plan.is_empty:
            self.structured.wait_idle()
            return failed + self._routed(outputs)
        now = time.time()
        for item in plan.scheduled:
            metrics = self._states[item.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        try:
            result = self.runner.execute(plan, self.scheduler.requests)
            self.num_steps += 1
            for request_id, scored in result.prompt_logprobs.items():
                self._states[request_id].request.prompt_logprobs.extend(scored)
            self.scheduler.update_from_output(plan, result.sampled)
            now = time.time()
            consume(
                [
                    (grammar, token_id)
                    for request_id, token_id in result.sampled.items()
                    if (grammar := self._states[request_id].request.grammar) is not None
                ]
            )
            constrained: list[tuple[_RequestState, StepOutput]] = []
            for request_id, token_id in result.sampled.items():
                state = self._states[request_id]
                token_logprobs = result.logprobs.get(request_id)
                if token_logprobs is not None:
                    state.request.logprobs.append(token_logprobs)
                step_output = self._process_token(state, token_id, now)
                outputs.append(step_output)
                # A forced token has no logits of its own: requests asking logprobs sample every token.
                if (
                    state.request.grammar is not None
                    and not step_output.finished
                    and state.request.sampling_params.logprobs is None
                ):
                    constrained.append((state, step_output))
            if constrained and self.structured.enable_fast_forward:
                self._fast_forward(constrained, now)
            self._release_prefilled_children()
        except Exception as exc:
            # Blocks cached as the plan was made may hold no K/V now.
            self.kv_cache_manager.discard_scheduled()
            # Which requests ran is known here and nowhere else: the caller aborts them.
            ran = [*plan.capacity_finished_request_ids, *(item.request_id for item in plan.scheduled)]
            ran = list(dict.fromkeys(self._parallel.caller_id(r) for r in ran))
            raise EngineStepError(f"{type(exc).__name__}: {exc}", ran) from exc
        return failed + self._routed(outputs)

    def _routed(self, outputs: list[StepOutput]) -> list[StepOutput]:
        if not self._parallel.has_children():
            return outputs
        return [routed for out in outputs if (routed := self._parallel.route(out)) is not None]

    # -- structured outputs ------------------------------------------------------------------

    def _start_compiled(self) -> list[StepOutput]:
        """Queue the requests whose grammar compiled; a finished, failed output for each whose
        grammar did not."""
        failed = []
        for waiting, error in self.structured.take_ready():
            if error is None:
                waiting.start()
                continue
            logger.info("request %s failed: %s", waiting.request_id, error)
            output = RequestOutput(
                request_id=waiting.request_id,
                prompt=None,
                prompt_token_ids=[],
                outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason=None)],
                finished=True,
                metrics=RequestMetrics(time.time(), finished_time=time.time()),
                error=RequestError(type(error).__name__, str(error)),
            )
            failed.append(StepOutput(waiting.request_id, [], "", True, None, output))
        return failed

    def _fast_forward(self, constrained: list[tuple[_RequestState, StepOutput]], now: float) -> None:
        """Where a grammar allows exactly one next token, append it without sampling: masked
        decoding could pick nothing else. The next step computes these tokens as a prefill chunk.
        Each forced token passes the same end checks as a sampled one (max_tokens, stop strings,
        the context), and joins its request's step output."""
        live = constrained
        for _ in range(MAX_FAST_FORWARD_TOKENS):
            grammars: list[GrammarState] = [state.request.grammar for state, _ in live]  # type: ignore[misc]
            tokens = forced_tokens(grammars)
            forced = [(item, token) for item, token in zip(live, tokens, strict=True) if token is not None]
            if not forced:
                return
            consume([(state.request.grammar, token) for (state, _), token in forced])  # type: ignore[misc]
            live = []
            for (state, step_output), token in forced:
                state.request.append_output_token(token)
                self.structured.num_fast_forward_tokens += 1
                more = self._process_token(state, token, now)
                step_output.new_token_ids.extend(more.new_token_ids)
                step_output.text_delta += more.text_delta
                if more.finished:
                    step_output.finished = True
                    step_output.finish_reason = more.finish_reason
                    step_output.output = more.output
                else:
                    live.append((state, step_output))
            if not live:
                return

    def _release_prefilled_children(self) -> None:
        if self._parallel.has_parents():
            for parent in list(self._parallel.prefilled(self.scheduler.requests)):
                self._release_children(parent)

    def _process_token(self, state: _RequestState, token_id: int, now: float) -> StepOutput:
        request = state.request
        params = request.sampling_params
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        status: RequestStatus | None = None
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        if request.num_output_tokens >= params.min_tokens:
            if is_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
        grammar = request.grammar
        if grammar is not None and status is None:
            if grammar.error is not None:
                status = RequestStatus.FINISHED_ABORTED
                state.error = RequestError("StructuredOutputError", grammar.error)
            elif grammar.is_stopped:
                # The grammar is complete: nothing else may follow, so stop without an EOS.
                status = RequestStatus.FINISHED_STOPPED
        if status is None and request.num_output_tokens >= params.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is None and request.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        detokenizer = state.detokenizer
        if detokenizer is not None and not (status is RequestStatus.FINISHED_STOPPED and is_eos):
            stop_string = detokenizer.update(token_id)
            if stop_string is not None and request.num_output_tokens >= params.min_tokens:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop_string
        finished = status is not None
        delta = detokenizer.take_delta(finished) if detokenizer is not None else ""
        step_output = StepOutput(request.request_id, [token_id], delta, finished)
        if status is not None:
            self.scheduler.finish_request(request.request_id, status)
            state.metrics.finished_time = now
            self._states.pop(request.request_id, None)
            step_output.finish_reason = status.finish_reason
            step_output.output = self._make_output(state)
        return step_output

    def _finish_capacity(self, request_id: str) -> StepOutput:
        state = self._states.pop(request_id)
        state.metrics.finished_time = time.time()
        logger.warning("request %s stopped: it alone fills the KV cache", request_id)
        delta = state.detokenizer.take_delta(True) if state.detokenizer is not None else ""
        return StepOutput(request_id, [], delta, True, "length", self._make_output(state))

    def _make_output(self, state: _RequestState) -> RequestOutput:
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
