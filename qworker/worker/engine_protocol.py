"""What the worker needs from an engine: add and abort requests, step, KV stats and prefix-cache
lookups, limits.

`qworker.engine.llm_engine.LLMEngine` satisfies this structurally, and so does the scripted
`qworker.testing.fake_engine.FakeEngine` that unit tests of the worker loop use. The types named
here are plain dataclasses: importing this module never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from qworker.config import EngineConfig
from qworker.engine.block_pool import KVCacheStats
from qworker.engine.outputs import PoolingRequestOutput, RequestOutput, StepOutput
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.resume import ResumeFrom
from qworker.engine.sampling_params import SamplingParams
from qworker.lora.request import LoRARequest

if TYPE_CHECKING:
    from qworker.engine.llm_engine import LLMEngine
    from qworker.testing.fake_engine import FakeEngine


class DeviceLike(Protocol):
    """Where the engine runs (a torch.device has this), so the worker can warn about threads."""

    @property
    def type(self) -> str: ...


class EngineProtocol(Protocol):
    """The engine as the worker loop sees it. Tokens and text in, step outputs out: no tensors."""

    @property
    def config(self) -> EngineConfig:
        """Admission reads `block_size` and `max_num_seqs`."""
        ...

    @property
    def device(self) -> DeviceLike: ...

    @property
    def tokenizer(self) -> Any:
        """None when the model has no tokenizer: then only `prompt_token_ids` jobs can run."""
        ...

    def tokenize(self, prompt: str) -> tuple[str | None, list[int]]:
        """(text, token ids) of a plain-text prompt."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation's prompt ids; `tools` and `chat_template_kwargs` as the job gives them."""
        ...

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What the model can do: a subset of ("generate", "embed", "classify", "score")."""
        ...

    def score_prompt(self, query: str, document: str) -> list[int]:
        """The one sequence a score request pools for (query, document), in the model's form."""
        ...

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
        """Queue a request; `prompt` is {"prompt_token_ids": [...], "prompt"?: text}. With
        `lora_request`, it runs with that LoRA adapter.

        With PoolingParams it is a prefill-only pooling request for one input: it finishes with
        a PoolingRequestOutput and no tokens.

        Raises an InvalidRequestError subclass for input that can never run (too long, ids
        outside the vocabulary, UnsupportedTaskError for a task the model cannot do). With
        `resume`, the request continues from output tokens an earlier attempt generated;
        ResumeRefusedError says it cannot (then add it without)."""
        ...

    def abort(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        """Stop a request now and free its KV blocks; its partial output, or None if unknown."""
        ...

    def step(self) -> list[StepOutput]:
        """One scheduling step: each scheduled request's new tokens and text; finished ones
        carry their whole output."""
        ...

    def loaded_adapter_names(self) -> list[str]:
        """The LoRA adapters the engine holds loaded now (empty without adapters)."""
        ...

    def adapter_loads(self) -> tuple[int, int]:
        """LoRA adapters loaded so far: (from their files into host memory, into device slots)."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def kv_stats(self) -> KVCacheStats: ...

    def num_cached_prefix_tokens(self, request_id: str) -> int:
        """Leading prompt tokens of a queued request that it would share from the prefix cache
        without taking a free block (in cached blocks that requests hold now); 0 when unknown or
        with no prefix cache. Admission counts the rest of the prompt. Changes nothing."""
        ...


if TYPE_CHECKING:
    # Static checks (mypy): both engines satisfy the protocol. Nothing runs here.
    def _llm_engine_is_an_engine(engine: LLMEngine) -> EngineProtocol:
        return engine

    def _fake_engine_is_an_engine(engine: FakeEngine) -> EngineProtocol:
        return engine
