from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import torch

from qworker.config import EngineConfig
from qworker.engine.block_pool import KVCacheStats
from qworker.engine.input_processor import InputProcessor, Prompt, resolve_max_model_len
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.output_processor import OutputProcessor
from qworker.engine.outputs import RequestOutput, StepOutput
from qworker.engine.parallel_sampling import ParentRequest, child_id, child_params
from qworker.engine.penalties import bad_words_token_ids
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.pooling_requests import PoolingRequests
from qworker.engine.request import Request, RequestStatus
from qworker.engine.resume import ResumeFrom, resume_problem
from qworker.engine.runner import ModelRunner
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler import Scheduler
from qworker.engine.score_prompt import score_prompt_ids
from qworker.engine.structured import StructuredOutputs
from qworker.engine.structured.manager import StructuredOutputManager
from qworker.engine.tasks import ModelTasks
from qworker.errors import EngineStepError, InvalidParamsError, InvalidRequestError, ResumeRefusedError
from qworker.lora.manager import LoRAManager, WaitingForAdapter
from qworker.lora.request import LoRARequest
from qworker.model.loader import load_hf_config, load_state_dict, load_tokenizer, resolve_model
from qworker.model.registry import model_config_from_hf
from qworker.quantization.scheme import resolve_quantization

__all__ = ["LLMEngine", "Prompt"]

logger = logging.getLogger(__name__)


class LLMEngine:
    """The engine core: add requests, step, read streamed outputs. Knows nothing of queues.

    Glue, as vLLM v1 splits the engine: the `scheduler` plans each step and alone changes the
    requests (it applies the token-level stops as it takes a step's output), the `runner` owns
    the device (weights, KV cache, its persistent input batch) and runs the plan, and the
    `output_processor` makes text, stop strings, logprob dicts and n > 1 outputs, and
    fast-forwards grammars.
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
        # Decided before the weights are used: a checkpoint quantized in a scheme qworker cannot
        # run fails here, in one line.
        plan = resolve_quantization(config.quantization, getattr(hf_config, "quantization_config", None))
        # What this engine runs ("int8" or None): a W8A8 file runs int8 without the option.
        self.quantization = plan.method if plan is not None else None
        self.model_config = model_config_from_hf(hf_config)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.runner = ModelRunner(
            config,
            self.model_config,
            self.max_model_len,
            state_dict=state_dict,
            eos_token_ids=self.eos_token_ids,
            quantization=plan,
        )
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_kv_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching and self.model_config.is_prefix_cacheable,
            # What decides a block's KV besides its tokens: this engine's weights and dtype.
            cache_salt=f"{config.model}|{self.runner.dtype}"
            + (f"|{self.quantization}" if self.quantization else ""),
        )
        # LoRA adapters: loaded off the step loop, device slots counted by the scheduler.
        self.lora = (
            LoRAManager(
                self.model_config,
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.num_cpu_loras,
            )
            if config.enable_lora
            else None
        )
        # n > 1 requests with an adapter: the adapter of their children still to queue.
        self._lora_of_parent: dict[str, LoRARequest] = {}
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            lora=self.lora,
        )
        # Grammars of structured-output requests; such a request waits there until it compiles.
        self.structured = StructuredOutputManager(
            tokenizer,
            self.model_config.vocab_size,
            sorted(self.eos_token_ids),
            disable_additional_properties=config.disable_additional_properties,
        )
        self.output_processor = OutputProcessor(tokenizer, self.structured)
        self.input_processor = InputProcessor(
            tokenizer, config, self.model_config, self.max_model_len, self.runner.num_kv_blocks
        )
        # What this model serves (generate, embed, classify, score: engine/tasks.py).
        self.tasks = ModelTasks.resolve(config, self.model_config, hf_config, tokenizer)
        self.pooling = PoolingRequests(
            self.tasks,
            self.input_processor,
            hidden_size=self.model_config.hidden_size,
            max_model_len=self.max_model_len,
            default_normalize=config.pooling_normalize,
        )
        # n > 1 requests: their children are requests of their own in the scheduler.
        self._parallel = self.output_processor.parallel
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

    # -- requests ----------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.input_processor.apply_chat_template(messages, tools, chat_template_kwargs)

    def validate_prompt_token_ids(self, token_ids: list[int]) -> None:
        self.input_processor.validate_prompt_token_ids(token_ids)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """A subset of ("generate", "embed", "classify", "score"): from the checkpoint and the
        runner/convert options (engine/tasks.py, docs/pooling.md)."""
        return self.tasks.supported

    def score_prompt(self, query: str, document: str) -> list[int]:
        """The one sequence a score request runs for (query, document), in this model's form: a
        cross-encoder's text pair or Qwen3-Reranker's yes/no prompt (engine/score_prompt.py)."""
        self.tasks.check("score")
        assert self.tasks.classifier_head is not None, "score is supported without a head"
        return score_prompt_ids(self.tokenizer, self.tasks.classifier_head, query, document)

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | PoolingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resume: ResumeFrom | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request. Raises a typed InvalidRequestError subclass for bad input.

        With `lora_request`, the request runs with that LoRA adapter (docs/lora.md). It waits,
        holding nothing, while the adapter loads; an adapter that cannot be used ends the request
        at a later step with a failed output (LoRAAdapterError), and only that request.

        With `params.n > 1` the request runs as n child requests sharing the prompt's KV blocks;
        its step outputs carry the parent id (text deltas of completion 0) and its final output
        holds the n completions.

        With `resume`, the request continues from output tokens an earlier run generated
        (engine/resume.py): they are prefilled with the prompt and count as output, only new
        tokens are emitted, and the final output holds them all. ResumeRefusedError says the
        request cannot continue from them (the caller may add it again without `resume`).

        With `params` a PoolingParams, `prompt` is one input (text or token ids), run prefill
        only; its finished StepOutput carries a PoolingRequestOutput (docs/pooling.md). A task
        the model cannot do raises UnsupportedTaskError.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise InvalidRequestError(
                f"params must be SamplingParams or PoolingParams, got {type(params).__name__}"
            )
        request_id = request_id or uuid.uuid4().hex
        if (
            request_id in self.output_processor
            or request_id in self._parallel
            or request_id in self.structured.waiting
            or (self.lora is not None and request_id in self.lora)
            or request_id in self.pooling
        ):
            raise InvalidRequestError(f"request id {request_id!r} is already in the engine")
        if isinstance(params, PoolingParams):
            if lora_request is not None or resume is not None:
                raise InvalidRequestError("pooling requests take no LoRA adapter and do not resume")
            self.scheduler.add_request(self.pooling.new_request(request_id, prompt, params, priority))
            return request_id
        self.tasks.check("generate")
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise InvalidRequestError(
                    f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
                )
            if self.lora is None:
                raise InvalidRequestError(
                    "a LoRA adapter was asked for, but this engine runs without enable_lora"
                )
        text, token_ids = self.tokenize(prompt)
        token_ids = self._truncate_prompt(token_ids, params)
        self.validate_prompt_token_ids(token_ids)
        params.check_model_limits(self.model_config.vocab_size)
        if params.bad_words and self.tokenizer is None:
            raise InvalidParamsError("bad_words needs the model's tokenizer; this engine has none")
        if resume is not None and resume.token_ids:
            self._check_resume(token_ids, params, resume)
        else:
            resume = None
        if params.n > 1 and any(child_id(request_id, i) in self.output_processor for i in range(params.n)):
            raise InvalidRequestError(f"request id {request_id!r} clashes with a request in the engine")
        arrival_time = arrival_time or time.time()
        # A request that waits for its adapter keeps its place in the queue.
        arrival_index: int | None = None

        def proceed() -> None:
            if params.structured_outputs is not None:
                # Compiles off this thread; the request joins the scheduler at a later step.
                self.structured.wait_for_grammar(
                    request_id,
                    StructuredOutputs.from_value(params.structured_outputs),
                    lambda: self._start(
                        request_id, text, token_ids, params, priority, arrival_time, lora_request=lora_request
                    ),
                )
                return
            self._start(
                request_id,
                text,
                token_ids,
                params,
                priority,
                arrival_time,
                resume,
                lora_request,
                arrival_index,
            )

        if lora_request is not None and self.lora is not None and not self.lora.is_loaded(lora_request):
            arrival_index = self.scheduler.take_arrival_index()
            # Loads off this thread; the request goes on at the step that finds it loaded.
            self.lora.wait_for_adapter(WaitingForAdapter(request_id, lora_request, proceed))
            return request_id
        proceed()
        return request_id

    def _truncate_prompt(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation); -1 keeps as
        many as the context holds with one generated token."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len - 1
        return token_ids[-keep:]

    def _encode_word(self, word: str) -> list[int]:
        return list(self.tokenizer.encode(word, add_special_tokens=False))

    def _check_resume(self, prompt_token_ids: list[int], params: SamplingParams, resume: ResumeFrom) -> None:
        problem = resume_problem(resume, params, eos_token_ids=self.eos_token_ids)
        if problem is None:
            try:
                self.validate_prompt_token_ids([*prompt_token_ids, *resume.token_ids])
            except InvalidRequestError as exc:
                problem = f"prompt + stored tokens: {exc}"
        if problem is not None:
            raise ResumeRefusedError(problem)

    def _start(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float,
        resume: ResumeFrom | None = None,
        lora_request: LoRARequest | None = None,
        arrival_index: int | None = None,
    ) -> None:
        if params.n == 1:
            self._enqueue(
                request_id,
                text,
                token_ids,
                params,
                priority,
                arrival_time,
                arrival_index,
                resume=resume,
                lora_request=lora_request,
            )
            return
        assert resume is None, "n > 1 requests do not resume (resume_problem)"
        parent = self._parallel.add(request_id, text, token_ids, params, priority, arrival_time)
        if lora_request is not None:
            self._lora_of_parent[parent.request_id] = lora_request
        self._enqueue(
            parent.first_child_id,
            text,
            token_ids,
            child_params(params, 0),
            priority,
            parent.arrival_time,
            lora_request=lora_request,
        )
        if not self.config.enable_prefix_caching:
            self._release_children(parent)

    def _release_children(self, parent: ParentRequest) -> None:
        # The others queue in completion 0's place, not behind requests that came after it.
        arrival_index = self.output_processor.arrival_index(parent.first_child_id)
        lora_request = self._lora_of_parent.pop(parent.request_id, None)
        for cid, params in parent.take_pending():
            self._enqueue(
                cid,
                parent.prompt,
                parent.token_ids,
                params,
                parent.priority,
                parent.arrival_time,
                arrival_index,
                lora_request=lora_request,
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
        *,
        resume: ResumeFrom | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if lora_request is not None and self.lora is not None and not self.lora.is_loaded(lora_request):
            # Evicted from host memory while its grammar compiled: load it again first.
            self.lora.wait_for_adapter(
                WaitingForAdapter(
                    request_id,
                    lora_request,
                    lambda: self._enqueue(
                        request_id, text, token_ids, params, priority, arrival_time, arrival_index,
                        resume=resume, lora_request=lora_request,
                    ),
                )
            )  # fmt: skip
            return
        output_token_ids = list(resume.token_ids) if resume is not None else []
        request = Request(
            request_id,
            token_ids,
            params,
            priority=priority,
            output_token_ids=output_token_ids,
            lora_request=lora_request,
            bad_words_token_ids=(
                bad_words_token_ids(params.bad_words, self._encode_word, self.model_config.vocab_size)
                if params.bad_words
                else ()
            ),
        )
        if params.structured_outputs is not None:
            request.grammar = self.structured.new_state(
                StructuredOutputs.from_value(params.structured_outputs)
            )
        # Raises ResumeRefusedError before the request is anywhere.
        self.output_processor.add_request(
            request, text, arrival_time, resume.text if resume is not None else None
        )
        self.scheduler.add_request(request, arrival_index)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a queued or running request now and free its blocks. Returns its partial output."""
        if self.structured.waiting.pop(request_id, None) is not None:
            return None  # its grammar was still compiling: nothing ran
        if self.lora is not None and self.lora.abort(request_id):
            return None  # its adapter was still loading: nothing ran
        parent = self._parallel.pop(request_id)
        if parent is not None:
            self._lora_of_parent.pop(request_id, None)
            for index, cid in enumerate(parent.child_ids):
                child_output = self.abort(cid)
                if child_output is not None:
                    parent.outputs[index] = child_output
            return parent.output() if parent.outputs else None
        if request_id in self.pooling:
            self.pooling.drop(request_id)
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
            return None  # a pooling request has no partial output
        if request_id not in self.output_processor:
            return None
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.finish_aborted(request_id, time.time())

    def loaded_adapter_names(self) -> list[str]:
        """The LoRA adapters loaded now (none without enable_lora), for the worker's report."""
        return self.lora.loaded_names() if self.lora is not None else []

    def adapter_loads(self) -> tuple[int, int]:
        """LoRA adapters loaded so far: (from their files into host memory, into device slots)."""
        return (self.lora.num_host_loads, self.lora.num_slot_loads) if self.lora is not None else (0, 0)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._parallel.has_pending_children()
            or bool(self.structured.waiting)
            or (self.lora is not None and self.lora.has_waiting)
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
        if self.lora is not None:
            failed += self._start_loaded()
        self._release_prefilled_children()
        plan = self.scheduler.schedule()
        processor = self.output_processor
        now = time.time()
        outputs = [processor.finish_capacity(r, now) for r in plan.capacity_finished_request_ids]
        if plan.is_empty:
            self.runner.update_batch(plan)  # the rows of requests that left
            self.structured.wait_idle()
            if self.lora is not None:
                self.lora.wait_idle()
            return failed + processor.route(outputs)
        processor.mark_scheduled(plan, now)
        try:
            result = self.runner.execute(plan)
            self.num_steps += 1
            updates = self.scheduler.update_from_output(plan, result)
            for request_id, pooled in result.pooled.items():
                finished = self.pooling.finish(request_id, pooled)
                if finished is not None:
                    outputs.append(finished)
            outputs.extend(processor.process(updates, self.scheduler, time.time()))
            self._release_prefilled_children()
        except Exception as exc:
            # Blocks cached as the plan was made may hold no K/V now.
            self.kv_cache_manager.discard_scheduled()
            if self.lora is not None:
                self.lora.mark_stale([slot for slot, _ in plan.lora_loads])
            # Which requests ran is known here and nowhere else: the caller aborts them.
            ran = [*plan.capacity_finished_request_ids, *(item.request_id for item in plan.scheduled)]
            ran = list(dict.fromkeys(self._parallel.caller_id(r) for r in ran))
            raise EngineStepError(f"{type(exc).__name__}: {exc}", ran) from exc
        return failed + processor.route(outputs)

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
            failed.append(self.output_processor.failed_before_start(waiting.request_id, error, time.time()))
        return failed

    def _start_loaded(self) -> list[StepOutput]:
        """Go on with the requests whose LoRA adapter loaded; a finished, failed output for each
        whose adapter could not be used."""
        assert self.lora is not None
        failed = []
        for waiting, error in self.lora.take_ready():
            if error is None:
                waiting.start()
                continue
            logger.info("request %s failed: %s", waiting.request_id, error)
            self._lora_of_parent.pop(waiting.request_id, None)
            failed.append(self.output_processor.failed_before_start(waiting.request_id, error, time.time()))
        self.lora.start_loads()  # after the loaded adapters' requests pinned them
        return failed

    def _release_prefilled_children(self) -> None:
        if self._parallel.has_parents():
            for parent in list(self._parallel.prefilled(self.scheduler.requests)):
                self._release_children(parent)
