"""Response bodies: a finished generation as OpenAI's `chat.completion` or `text_completion`.

A Generation is what a finished request produced, read from the engine's RequestOutput (local
mode) or from a stored job result (pool mode). Its completions follow vLLM's shapes:
`CompletionOutput.index/.text/.token_ids/.finish_reason`, and, when the row asked for logprobs,
`CompletionOutput.logprobs: list[dict[int, Logprob]]` (one dict per generated token, holding the
sampled token and the top alternatives, each with `.logprob`, `.rank`, `.decoded_token`) and
`RequestOutput.prompt_logprobs: list[dict[int, Logprob] | None]` (None for the first prompt
token, which has nothing before it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from qworker.openai.chat_output import parse_message
from qworker.openai.format import (
    MIN_LOGPROB,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    RowError,
    TextChoice,
    TextCompletion,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from qworker.openai.rows import Endpoint, RowRequest


class LogprobLike(Protocol):
    """vLLM's Logprob: one token's log probability, its rank in the distribution (1: the most
    likely) and its text."""

    @property
    def logprob(self) -> float: ...

    @property
    def rank(self) -> int | None: ...

    @property
    def decoded_token(self) -> str | None: ...


PositionLogprobs = Mapping[int, LogprobLike]
# A token id's text, for entries whose decoded_token is not set.
Decode = Callable[[int], str]


@dataclass
class _ScoredCompletion:
    """A completion of a scoring-only row (max_tokens 0): nothing generated."""

    index: int
    text: str = ""
    token_ids: Sequence[int] = ()
    finish_reason: str = "length"
    logprobs: Sequence[PositionLogprobs] | None = None


@dataclass
class Generation:
    """What a finished request produced: its completions (n of them, by index) and prompt size."""

    num_prompt_tokens: int
    # Engine CompletionOutput objects, or anything of their shape.
    completions: Sequence[Any]
    prompt_token_ids: Sequence[int] | None = None
    prompt_logprobs: Sequence[PositionLogprobs | None] | None = None
    # Prompt tokens whose KV came from a prefix cache (usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0

    @classmethod
    def from_request_output(cls, output: Any, *, with_prompt_logprobs: bool = False) -> Generation:
        """From the engine's RequestOutput. `prompt_logprobs` is read only when the row asked for
        it, so that engines without the field serve every other row."""
        return cls(
            num_prompt_tokens=len(output.prompt_token_ids),
            completions=sorted(output.outputs, key=lambda c: c.index),
            prompt_token_ids=list(output.prompt_token_ids),
            prompt_logprobs=output.prompt_logprobs if with_prompt_logprobs else None,
            num_cached_tokens=getattr(output, "num_cached_tokens", 0),
        )


def _token_text(token_id: int, entry: LogprobLike | None, decode: Decode | None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    # vLLM's spelling of a token it does not decode (its return_tokens_as_token_ids).
    return decode(token_id) if decode is not None else f"token_id:{token_id}"


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


def top_entries(position: PositionLogprobs, num_top: int) -> list[tuple[int, LogprobLike]]:
    """The `num_top` most likely tokens of one position, most likely first. A position holds the
    sampled token and the top alternatives; the sampled token counts only where its rank earns it."""
    ranked = sorted(
        position.items(),
        key=lambda item: (item[1].rank if item[1].rank is not None else math.inf, -item[1].logprob),
    )
    return ranked[:num_top]


def choice_logprobs_chat(
    token_ids: Sequence[int],
    logprobs: Sequence[PositionLogprobs],
    num_top: int,
    decode: Decode | None = None,
) -> ChatLogprobs:
    """OpenAI's chat shape: `content[i] = {token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}` for each generated token."""
    assert len(logprobs) == len(token_ids), f"{len(logprobs)} logprob positions for {len(token_ids)} tokens"
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=True):
        sampled = position[token_id]
        token = _token_text(token_id, sampled, decode)
        top = []
        for top_id, entry in top_entries(position, num_top):
            text = _token_text(top_id, entry, decode)
            top.append(TopLogprob(token=text, logprob=_finite(entry.logprob), bytes=list(text.encode())))
        content.append(
            TokenLogprob(
                token=token, logprob=_finite(sampled.logprob), bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def choice_logprobs_completion(
    token_ids: Sequence[int],
    logprobs: Sequence[PositionLogprobs | None],
    num_top: int,
    decode: Decode | None = None,
    initial_text_offset: int = 0,
) -> CompletionLogprobs:
    """OpenAI's legacy completions shape: parallel lists `tokens`, `token_logprobs`, `top_logprobs`
    (a {token: logprob} dict per position: the `num_top` most likely tokens, plus the sampled one
    when it is not among them, as OpenAI documents) and `text_offset`. A position without
    logprobs (the first prompt token, under echo) has None in both logprob lists."""
    assert len(logprobs) == len(token_ids), f"{len(logprobs)} logprob positions for {len(token_ids)} tokens"
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = initial_text_offset
    for token_id, position in zip(token_ids, logprobs, strict=True):
        if position is None:
            token = _token_text(token_id, None, decode)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            sampled = position[token_id]
            token = _token_text(token_id, sampled, decode)
            out.token_logprobs.append(_finite(sampled.logprob))
            top = {
                _token_text(top_id, entry, decode): _finite(entry.logprob)
                for top_id, entry in top_entries(position, num_top)
            }
            # OpenAI's legacy format always holds the sampled token: up to num_top + 1 entries.
            top.setdefault(token, _finite(sampled.logprob))
            out.top_logprobs.append(top)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def _finish_reason(completion: Any) -> Any:
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise RowError(
            f"the generation ended with finish_reason {reason!r}", status_code=500, code="server_error"
        )
    return reason


def _usage(generation: Generation) -> Usage:
    num_completion = sum(len(c.token_ids) for c in generation.completions)
    return Usage(
        prompt_tokens=generation.num_prompt_tokens,
        completion_tokens=num_completion,
        total_tokens=generation.num_prompt_tokens + num_completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=generation.num_cached_tokens),
    )


def call_id_seed(row: RowRequest, index: int) -> str:
    """What the ids of completion `index`'s tool calls derive from (the stream's ids too)."""
    return f"{row.request_id}/{index}"


def chat_completion_body(
    row: RowRequest, generation: Generation, created: int, decode: Decode | None = None
) -> ChatCompletion:
    choices = []
    for completion in generation.completions:
        logprobs = None
        if row.num_top_logprobs is not None:
            logprobs = choice_logprobs_chat(
                completion.token_ids, completion.logprobs, row.num_top_logprobs, decode
            )
        message = AssistantMessage(content=completion.text)
        finish_reason = _finish_reason(completion)
        if row.output_parsing.is_active:
            parsed = parse_message(row.output_parsing, completion.text, call_id_seed(row, completion.index))
            message = AssistantMessage(
                content=parsed.content,
                tool_calls=parsed.tool_calls,
                reasoning_content=parsed.reasoning,
                reasoning=parsed.reasoning,
            )
            if parsed.tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        choices.append(
            ChatChoice(
                index=completion.index, message=message, logprobs=logprobs, finish_reason=finish_reason
            )
        )
    return ChatCompletion(
        id=f"chatcmpl-{row.request_id.replace('-', '')}",
        created=created,
        model=row.model,
        choices=choices,
        usage=_usage(generation),
    )


def text_completion_body(
    row: RowRequest, generation: Generation, created: int, decode: Decode | None = None
) -> TextCompletion:
    prefix = row.prompt if row.echo and isinstance(row.prompt, str) else ""
    if row.is_scoring_only:
        # max_tokens 0: the one token the engine generated is not part of the answer.
        generation = dataclasses.replace(
            generation,
            completions=[
                _ScoredCompletion(c.index, logprobs=[] if c.logprobs is not None else None)
                for c in generation.completions
            ],
        )
    choices = []
    for completion in generation.completions:
        logprobs = None
        if row.num_top_logprobs is not None:
            token_ids = list(completion.token_ids)
            positions: list[PositionLogprobs | None] = list(completion.logprobs)
            if row.num_prompt_logprobs is not None:
                assert generation.prompt_token_ids is not None and generation.prompt_logprobs is not None, (
                    "echo with logprobs needs the prompt's token ids and logprobs"
                )
                token_ids = [*generation.prompt_token_ids, *token_ids]
                positions = [*generation.prompt_logprobs, *positions]
            logprobs = choice_logprobs_completion(token_ids, positions, row.num_top_logprobs, decode)
        choices.append(
            TextChoice(
                index=completion.index,
                text=prefix + completion.text,
                logprobs=logprobs,
                finish_reason=_finish_reason(completion),
            )
        )
    return TextCompletion(
        id=f"cmpl-{row.request_id.replace('-', '')}",
        created=created,
        model=row.model,
        choices=choices,
        usage=_usage(generation),
    )


def response_body(
    row: RowRequest, generation: Generation, created: int, decode: Decode | None = None
) -> ChatCompletion | TextCompletion:
    if row.endpoint is Endpoint.CHAT:
        return chat_completion_body(row, generation, created, decode)
    return text_completion_body(row, generation, created, decode)
