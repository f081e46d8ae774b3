"""A scripted engine for unit tests of the worker loop: no model, no torch.

Each running request emits one token per step, taken from its script (by default the letters
a..z over and over), and finishes at `max_tokens` ("length") or when its script ends ("stop").
Tokens are UTF-8 bytes (a vocabulary of 256), so a token's text is its byte. KV blocks are
accounted like the real engine's, closely enough for admission: a request holds
ceil((tokens + 1) / block_size) blocks while it runs and waits while that does not fit; when a
running request cannot grow, the newest running one is preempted (its blocks freed, its output
kept, back to the head of the waiting line), and a request that alone fills the cache finishes
with "length".

Pooling requests (PoolingParams) are prefill-only as in the real engine: one takes its prompt's
blocks (ceil(tokens / block_size), no slot for a next token) when it starts and finishes in that
step with a PoolingRequestOutput whose vector `fake_pooled_vector` computes from its tokens. That
output holds a torch tensor, as the engine's does: only the pooling path imports torch.
`supported_tasks` says what the fake model can do; a request for another task is refused with
UnsupportedTaskError, as the engine refuses it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qworker.config import EngineConfig
from qworker.engine.block_pool import KVCacheStats
from qworker.engine.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    StepOutput,
)
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.resume import ResumeFrom
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import (
    EngineStepError,
    InvalidParamsError,
    InvalidRequestError,
    PromptTooLongError,
    ResumeRefusedError,
    UnsupportedTaskError,
)
from qworker.lora.request import LoRARequest
from qworker.utils import cdiv

VOCAB_SIZE = 256
DEFAULT_SCRIPT = list(b"abcdefghijklmnopqrstuvwxyz") * 10

# (request id, prompt token ids) -> the tokens the request emits, one per step.
Script = Callable[[str, list[int]], list[int]]
ALL_TASKS = ("generate", "embed", "classify", "score")
# The fake model's hidden size (an embedding's length) and its classes.
HIDDEN_SIZE = 8
NUM_CLASSES = 3


def fake_pooled_vector(token_ids: list[int], params: PoolingParams) -> list[float]:
    """What the fake engine pools for `token_ids` (after truncation): an embedding of HIDDEN_SIZE
    values (each a sum over the tokens with its own weights), L2-normalised unless `normalize` is
    False, cut to `dimensions` first; NUM_CLASSES probabilities for classify (softmax; raw with
    use_activation=False); one sigmoid score for score. Deterministic, so tests compute it too."""
    raw = [
        sum(((t * (j + 3)) % 17 - 8) / 8 * (p + 1) ** -0.5 for p, t in enumerate(token_ids))
        for j in range(HIDDEN_SIZE)
    ]
    if params.task == "embed":
        values = raw[: params.dimensions] if params.dimensions is not None else raw
        if params.normalize is False:
            return values
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        return [v / norm for v in values]
    if params.task == "classify":
        logits = raw[:NUM_CLASSES]
        if params.use_activation is False:
            return logits
        exps = [math.exp(v - max(logits)) for v in logits]
        return [e / sum(exps) for e in exps]
    score = sum(raw) / HIDDEN_SIZE
    return [score] if params.use_activation is False else [1 / (1 + math.exp(-score))]


@dataclass(frozen=True)
class FakeDevice:
    type: str = "cpu"


class ByteTokenizer:
    """One token per UTF-8 byte."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode(errors="replace")


@dataclass
class _FakeRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    script: list[int]
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    # 0 while waiting: blocks are taken when the request starts.
    num_blocks: int = 0
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class FakeEngine:
    """Satisfies qworker.worker.engine_protocol.EngineProtocol with scripted outputs.

    `on_step(n)` runs at the start of step n (1-based): a test's hook to act mid-run (cancel a
    job, expire a lease, stop the worker). `failing_steps` makes steps fail as a broken model
    would: step n raises EngineStepError naming the requests it ran, after taking their blocks
    (`failing_steps[n]` is the request ids to name, or None for every running one). `added` and
    `aborted` record request ids in order.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        script: Script | None = None,
        has_tokenizer: bool = True,
        max_model_len: int = 256,
        supported_tasks: tuple[str, ...] = ALL_TASKS,
    ) -> None:
        self.config = config or EngineConfig(model="fake", block_size=4, num_kv_blocks=64, max_num_seqs=8)
        assert self.config.num_kv_blocks is not None, "the fake engine needs num_kv_blocks"
        self.num_kv_blocks = self.config.num_kv_blocks
        self.max_model_len = max_model_len
        self.device = FakeDevice()
        self.supported_tasks = supported_tasks
        self.tokenizer: ByteTokenizer | None = ByteTokenizer() if has_tokenizer else None
        self.script = script or (lambda request_id, prompt_token_ids: DEFAULT_SCRIPT)
        self.on_step: Callable[[int], None] | None = None
        self.failing_steps: dict[int, list[str] | None] = {}
        self.num_steps = 0
        self.added: list[str] = []
        # request id -> the LoRA adapter it was added with (None: the base model).
        self.adapters: dict[str, LoRARequest | None] = {}
        self.aborted: list[str] = []
        self._waiting: list[_FakeRequest] = []
        self._running: list[_FakeRequest] = []

    # -- prompts -----------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> tuple[str | None, list[int]]:
        assert self.tokenizer is not None, "the worker checks for a tokenizer first"
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        return prompt, self.tokenizer.encode(prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        assert self.tokenizer is not None, "the worker checks for a tokenizer first"
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.tokenizer.encode(text)

    def score_prompt(self, query: str, document: str) -> list[int]:
        """The query's bytes, a separator (0), the document's bytes."""
        assert self.tokenizer is not None, "the worker checks for a tokenizer first"
        return [*self.tokenizer.encode(query), 0, *self.tokenizer.encode(document)]

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        resume: ResumeFrom | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """As LLMEngine.add_request (a pooling request: see the module's docstring). With
        `resume`, the request continues its script after the
        given tokens, which must be the script's first ones (else ResumeRefusedError), and fewer
        than max_tokens. `lora_request` is recorded in `adapters` (the script does not change)."""
        self.adapters[request_id] = lora_request
        if any(r.request_id == request_id for r in (*self._waiting, *self._running)):
            raise InvalidRequestError(f"request id {request_id!r} is already in the engine")
        token_ids = list(prompt["prompt_token_ids"])
        if not token_ids:
            raise InvalidRequestError("prompt is empty (no tokens)")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB_SIZE:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {VOCAB_SIZE})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; the model's context is {self.max_model_len}"
            )
        if cdiv(len(token_ids) + 1, self.config.block_size) > self.num_kv_blocks:
            raise PromptTooLongError(f"prompt of {len(token_ids)} tokens does not fit in the KV cache")
        task = params.task if isinstance(params, PoolingParams) else "generate"
        if task not in self.supported_tasks:
            raise UnsupportedTaskError(
                f"the model {self.config.model!r} cannot {task}: "
                f"it supports {', '.join(self.supported_tasks)}"
            )
        if isinstance(params, PoolingParams):
            if params.dimensions is not None and params.dimensions > HIDDEN_SIZE:
                raise InvalidParamsError(
                    f"dimensions {params.dimensions} is above the hidden size {HIDDEN_SIZE}"
                )
            if params.truncate_prompt_tokens is not None:
                token_ids = token_ids[-params.truncate_prompt_tokens :]
            self._waiting.append(
                _FakeRequest(
                    request_id,
                    prompt.get("prompt"),
                    token_ids,
                    params,
                    [],
                    RequestMetrics(arrival_time=arrival_time or time.time()),
                )
            )
            self.added.append(request_id)
            return request_id
        params.check_model_limits(VOCAB_SIZE)
        script = list(self.script(request_id, token_ids))
        assert script, f"the script gave request {request_id} no tokens"
        resumed = list(resume.token_ids) if resume is not None else []
        if resumed and (
            resumed != script[: len(resumed)] or len(resumed) >= min(params.max_tokens, len(script))
        ):
            raise ResumeRefusedError(f"{len(resumed)} stored tokens are not a start of the script's")
        self._waiting.append(
            _FakeRequest(
                request_id,
                prompt.get("prompt"),
                token_ids,
                params,
                script,
                RequestMetrics(arrival_time=arrival_time or time.time()),
                output_token_ids=resumed,
            )
        )
        self.added.append(request_id)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        for queue in (self._waiting, self._running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.aborted.append(request_id)
                    request.finish_reason = "abort"
                    request.metrics.finished_time = time.time()
                    if isinstance(request.params, PoolingParams):
                        return None  # nothing pooled yet
                    return self._output(request)
        return None

    def loaded_adapter_names(self) -> list[str]:
        """The adapters of the requests added so far, as an engine that kept them all loaded."""
        return sorted({r.lora_name for r in self.adapters.values() if r is not None})

    def adapter_loads(self) -> tuple[int, int]:
        """Each adapter loaded once, into host memory and a slot, as loaded_adapter_names says."""
        num_loaded = len(self.loaded_adapter_names())
        return num_loaded, num_loaded

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def kv_stats(self) -> KVCacheStats:
        num_used = sum(r.num_blocks for r in self._running)
        num_stored = sum(r.num_tokens for r in self._running)
        return KVCacheStats(
            block_size=self.config.block_size,
            num_total_blocks=self.num_kv_blocks,
            num_free_blocks=self.num_kv_blocks - num_used,
            num_used_blocks=num_used,
            num_tokens_stored=num_stored,
            num_empty_slots=num_used * self.config.block_size - num_stored,
        )

    def num_cached_prefix_tokens(self, request_id: str) -> int:
        """The fake engine has no prefix cache: every job needs all its prompt's blocks."""
        return 0

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(self.num_steps)
        now = time.time()
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            # A pooling request needs its prompt's blocks only; a generation one a slot more.
            num_slots = request.num_tokens + (0 if isinstance(request.params, PoolingParams) else 1)
            num_blocks = cdiv(num_slots, self.config.block_size)
            if num_blocks > self.kv_stats().num_free_blocks:
                break
            self._waiting.pop(0)
            request.num_blocks = num_blocks
            request.metrics.first_scheduled_time = now
            self._running.append(request)
        if self.num_steps in self.failing_steps:
            named = self.failing_steps[self.num_steps]
            ran = [r.request_id for r in self._running] if named is None else named
            raise EngineStepError(f"RuntimeError: scripted failure of step {self.num_steps}", ran)
        outputs = []
        for request in list(self._running):
            if request not in self._running:
                continue  # preempted earlier in this step
            if isinstance(request.params, PoolingParams):
                outputs.append(self._pool(request, request.params, now))
                continue
            # Room for the token after this one, as the real scheduler reserves a slot.
            num_needed = cdiv(request.num_tokens + 1, self.config.block_size) - request.num_blocks
            while num_needed > self.kv_stats().num_free_blocks and self._running[-1] is not request:
                self._preempt(self._running[-1])
            if num_needed > self.kv_stats().num_free_blocks:
                if len(self._running) == 1:
                    outputs.append(self._finish(request, "length", [], now))
                else:
                    self._preempt(request)
                continue
            request.num_blocks += max(0, num_needed)
            outputs.append(self._emit(request, now))
        return outputs

    def _pool(self, request: _FakeRequest, params: PoolingParams, now: float) -> StepOutput:
        """A pooling request's one step: its vector, its blocks freed."""
        import torch

        self._running.remove(request)
        request.finish_reason = "stop"
        request.metrics.finished_time = now
        vector = fake_pooled_vector(request.prompt_token_ids, params)
        output = PoolingRequestOutput(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=PoolingOutput(data=torch.tensor(vector, dtype=torch.float32)),
            finished=True,
        )
        return StepOutput(request.request_id, [], "", True, "stop", output)

    def _preempt(self, request: _FakeRequest) -> None:
        self._running.remove(request)
        request.num_blocks = 0
        self._waiting.insert(0, request)

    def _emit(self, request: _FakeRequest, now: float) -> StepOutput:
        assert isinstance(request.params, SamplingParams), "a pooling request never emits a token"
        token_id = request.script[len(request.output_token_ids)]
        request.output_token_ids.append(token_id)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        num_output_tokens = len(request.output_token_ids)
        if num_output_tokens >= request.params.max_tokens or request.num_tokens >= self.max_model_len:
            request.finish_reason = "length"
        elif num_output_tokens >= len(request.script):
            request.finish_reason = "stop"
        if request.finish_reason is not None:
            return self._finish(request, request.finish_reason, [token_id], now)
        return StepOutput(request.request_id, [token_id], bytes([token_id]).decode(errors="replace"), False)

    def _finish(
        self, request: _FakeRequest, finish_reason: str, new_token_ids: list[int], now: float
    ) -> StepOutput:
        self._running.remove(request)
        request.finish_reason = finish_reason
        request.metrics.finished_time = now
        text = bytes(new_token_ids).decode(errors="replace")
        return StepOutput(request.request_id, new_token_ids, text, True, finish_reason, self._output(request))

    def _output(self, request: _FakeRequest) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=bytes(request.output_token_ids).decode(errors="replace"),
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.finish_reason is not None,
            metrics=request.metrics,
        )
