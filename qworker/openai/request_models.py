"""Request models: what the OpenAPI schema publishes, and a first type check. Field rules (ranges,
defaults, fields qworker cannot honour) are qworker batch's (rows.parse_row), applied afterwards to
the same body: extra fields pass through here so that they get parse_row's precise error."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(default=None, description="The served model's name (GET /v1/models)")
    stream: bool | None = None
    stream_options: dict[str, Any] | None = Field(default=None, description='{"include_usage": true}')
    n: int | None = Field(default=None, description="Completions per prompt, 1-128")
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, description="vLLM's top_k; 0 or -1: off")
    min_p: float | None = None
    min_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = Field(default=None, description="-2 to 2, over the generated tokens")
    frequency_penalty: float | None = Field(default=None, description="-2 to 2, per occurrence in the output")
    repetition_penalty: float | None = Field(
        default=None, description="vLLM's: > 0 (1 is off), over the prompt and the output"
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id -> bias in [-100, 100], at most 300 entries"
    )
    allowed_token_ids: list[int] | None = Field(default=None, description="vLLM's: only these tokens")
    bad_words: list[str] | None = Field(default=None, description="vLLM's: words whose tokens are banned")
    truncate_prompt_tokens: int | None = Field(
        default=None, description="vLLM's: keep the prompt's last k tokens (-1: as the context allows)"
    )
    priority: int | None = Field(
        default=None, description="vLLM's priority: lower runs first (the job's priority)"
    )
    affinity: str | None = Field(
        default=None,
        description="qworker's affinity key: jobs with one key go to the worker holding their prefix "
        "(default: derived from the prompt's start)",
    )


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Body):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, description="0-20, with logprobs: true")


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of token ids, or a list of either (one job each)"
    )
    echo: bool | None = None
    logprobs: int | None = Field(default=None, description="Top alternatives per token, 0-20")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]
