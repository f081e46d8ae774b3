"""What a prompt must be before it enters the engine (vLLM v1's `v1/engine/processor.py`): text
or token ids, a chat template applied, token ids checked against the vocabulary, the context, the
KV cache and the step budget. Changes no engine state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qworker.config import EngineConfig
from qworker.engine.structured.tool_calls import template_inputs
from qworker.errors import InvalidConfigError, InvalidRequestError, PromptTooLongError
from qworker.model.config import ModelConfig
from qworker.utils import cdiv

__all__ = ["InputProcessor", "Prompt", "resolve_max_model_len"]

Prompt = str | dict[str, Any] | Sequence[int]


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context: the model's, or the smaller one the config asks."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise InvalidConfigError(
                f"max_model_len {config.max_model_len} exceeds the model's {limit} (max_position_embeddings)"
            )
        limit = config.max_model_len
    return limit


class InputProcessor:
    """Turns prompts into token ids and checks them; bad input raises a typed InvalidRequestError."""

    def __init__(
        self,
        tokenizer: Any,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        num_kv_blocks: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks

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

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation's prompt ids. `tools` (OpenAI's function tools) go to a template that
        renders them, else into a system message (structured/tool_calls.py); `chat_template_kwargs`
        are the template's own variables (Qwen3's `enable_thinking`)."""
        if not messages:
            raise InvalidRequestError("messages is empty")
        messages, template_tools = template_inputs(messages, self.tokenizer.chat_template or "", tools)
        kwargs = dict(chat_template_kwargs or {})
        if template_tools is not None:
            kwargs["tools"] = template_tools
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def validate_prompt_token_ids(self, token_ids: list[int], *, prefill_only: bool = False) -> None:
        """`prefill_only`: a pooling request, which generates nothing, so its prompt may fill the
        context and needs no block for a next token."""
        if not token_ids:
            raise InvalidRequestError("prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if prefill_only and len(token_ids) > self.max_model_len:
            raise PromptTooLongError(
                f"input has {len(token_ids)} tokens; the model's context is {self.max_model_len} "
                "(truncate_prompt_tokens keeps the last ones)"
            )
        if not prefill_only and len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; the model's context is {self.max_model_len} "
                "(prompt plus at least one generated token must fit)"
            )
        blocks = cdiv(len(token_ids) + (0 if prefill_only else 1), self.config.block_size)
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
