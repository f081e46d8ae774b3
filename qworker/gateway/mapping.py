"""An OpenAI request body as jobs, with the code that maps `qworker batch` rows (rows.parse_row,
pool.job_for): one source of truth for field names, ranges and defaults. What the gateway adds is
what a batch row cannot have: `stream` and `stream_options`, vLLM's `priority`, and several
prompts in one completions body (one job each; choice i of prompt p gets index p * n + i, as
OpenAI indexes them).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from qworker.gateway.errors import GatewayError
from qworker.gateway.settings import GatewaySettings
from qworker.gateway.tokenizer import ChatTemplateError, GatewayTokenizer
from qworker.jobs.job import MAX_JOB_BYTES, MAX_PRIORITY, MIN_PRIORITY, Job, encode_job
from qworker.openai.batches.pool import job_for
from qworker.openai.format import CHAT_URL, COMPLETIONS_URL, RowError
from qworker.openai.rows import Endpoint, RowRequest, parse_row
from qworker.openai.tool_parsers import parser_for_template
from qworker.pool.demand import MESSAGE_OVERHEAD_TOKENS, job_blocks

# Prompts in one completions body: each becomes a job.
MAX_PROMPTS = 256
# Completions in one request, over all its prompts (n per prompt).
MAX_CHOICES = 1024
# Without a tokenizer, text is sized at this many characters per token (as demand.py does).
CHARS_PER_TOKEN = 4.0
URL_OF_ENDPOINT = {Endpoint.CHAT: CHAT_URL, Endpoint.COMPLETIONS: COMPLETIONS_URL}


@dataclass(frozen=True)
class PreparedRequest:
    """A body that can run: one row and one job per prompt."""

    endpoint: Endpoint
    request_id: str
    created: int
    rows: list[RowRequest]
    jobs: list[Job]
    # Token-id prompts with echo: their text, decoded here (a text prompt echoes itself).
    echo_texts: list[str | None]
    num_prompt_tokens: list[int]
    num_blocks: int
    stream: bool
    include_usage: bool

    @property
    def job_ids(self) -> list[str]:
        return [job.id for job in self.jobs]

    @property
    def n(self) -> int:
        return self.rows[0].sampling.get("n", 1)


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def split_prompts(prompt: Any) -> list[Any]:
    """A completions prompt as OpenAI reads it: a string, a token list, or a list of either."""
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str) or _is_token_list(p) for p in prompt)
    ):
        if len(prompt) > MAX_PROMPTS:
            raise GatewayError(
                400, f"prompt holds {len(prompt)} prompts; the limit is {MAX_PROMPTS}", param="prompt"
            )
        return list(prompt)
    return [prompt]


def _gateway_fields(body: dict[str, Any]) -> tuple[bool, bool, int | None]:
    stream = body.pop("stream", None)
    if stream not in (None, True, False):
        raise GatewayError(400, f"stream must be true or false, got {stream!r}", param="stream")
    options = body.pop("stream_options", None)
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise GatewayError(
                400, "stream_options must be an object with include_usage", param="stream_options"
            )
        include_usage = options.get("include_usage") is True
        if options.get("include_usage") not in (None, True, False):
            raise GatewayError(
                400, "stream_options.include_usage must be true or false", param="stream_options"
            )
        if not stream:
            raise GatewayError(
                400, "stream_options is only allowed with stream: true", param="stream_options"
            )
    priority = body.pop("priority", None)
    if priority is not None and (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise GatewayError(400, f"priority must be a 64-bit integer, got {priority!r}", param="priority")
    return bool(stream), include_usage, priority


def count_prompt_tokens(row: RowRequest, tokenizer: GatewayTokenizer | None) -> int:
    """Exact with a tokenizer (the chat template applied, as the worker does), else estimated."""
    if isinstance(row.prompt, list):
        return len(row.prompt)
    if tokenizer is not None:
        if row.messages is not None and tokenizer.chat_template:
            try:
                text = tokenizer.render_chat(
                    row.messages, tools=row.tools, chat_template_kwargs=row.chat_template_kwargs
                )
            except ChatTemplateError as exc:
                # The worker would fail the job the same way: say so now.
                raise GatewayError(400, str(exc), param="messages") from None
            return len(tokenizer.encode(text, add_special_tokens=False))
        if isinstance(row.prompt, str):
            return len(tokenizer.encode(row.prompt))
    texts = [m["content"] for m in row.messages or []] if row.messages is not None else [row.prompt or ""]
    overhead = MESSAGE_OVERHEAD_TOKENS * len(row.messages or [])
    return sum(math.ceil(len(t) / CHARS_PER_TOKEN) for t in texts) + overhead


def _check_context(row: RowRequest, num_prompt_tokens: int, max_model_len: int | None) -> None:
    if max_model_len is None:
        return
    # truncate_prompt_tokens: the worker keeps only the prompt's last k tokens (-1: max_model_len - 1).
    keep = row.sampling.get("truncate_prompt_tokens")
    if isinstance(keep, int) and not isinstance(keep, bool) and (keep >= 1 or keep == -1):
        num_prompt_tokens = min(num_prompt_tokens, max_model_len - 1 if keep == -1 else keep)
    param = "messages" if row.messages is not None else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise GatewayError(
            400,
            f"the prompt is {num_prompt_tokens} tokens; this model's context is {max_model_len} tokens "
            "(the prompt plus at least one generated token must fit)",
            code="context_length_exceeded",
            param=param,
        )
    if row.max_tokens is not None and num_prompt_tokens + row.max_tokens > max_model_len:
        raise GatewayError(
            400,
            f"max_tokens {row.max_tokens} plus the prompt's {num_prompt_tokens} tokens exceed this "
            f"model's context of {max_model_len} tokens",
            code="context_length_exceeded",
            param="max_tokens",
        )


def tool_call_parser(settings: GatewaySettings, tokenizer: GatewayTokenizer | None) -> str | None:
    """--tool-call-parser, else the one the chat template of the gateway's tokenizer asks for
    (hermes while no tokenizer is found yet: the format of the system message written for
    templates that render no tools); None where the template is ambiguous."""
    if settings.tool_call_parser is not None:
        return settings.tool_call_parser
    return parser_for_template(tokenizer.chat_template if tokenizer is not None else None)


def prepare(
    body: Any, endpoint: Endpoint, settings: GatewaySettings, tokenizer: GatewayTokenizer | None
) -> PreparedRequest:
    """The body's jobs, or GatewayError (4xx) saying what to fix. Nothing is enqueued here."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_body")
    body = dict(body)
    stream, include_usage, priority = _gateway_fields(body)
    prompts = split_prompts(body.get("prompt")) if endpoint is Endpoint.COMPLETIONS else [None]
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    if len(prompts) * max(1, n) > MAX_CHOICES:
        raise GatewayError(400, f"{len(prompts)} prompts times n={n} exceed {MAX_CHOICES} choices", param="n")
    request_id = uuid.uuid4().hex
    rows, jobs, echo_texts, counts = [], [], [], []
    num_blocks = 0
    for index, prompt in enumerate(prompts):
        row_body = body if prompt is None else {**body, "prompt": prompt}
        try:
            row = parse_row(
                str(index),
                URL_OF_ENDPOINT[endpoint],
                row_body,
                batch_id=request_id,
                served_model_names=[settings.model],
                adapter_names=settings.adapter_names,
                echo_token_prompts=tokenizer is not None,
                tool_call_parser=tool_call_parser(settings, tokenizer),
                reasoning_parser=settings.reasoning_parser,
            )
            job = job_for(row, settings.default_max_tokens)
        except RowError as exc:
            if exc.param == "echo":
                raise GatewayError(
                    400, "echo of a token-id prompt needs the gateway's tokenizer", param="echo"
                ) from None
            raise GatewayError.from_row_error(exc) from None
        updates: dict[str, Any] = {
            "metadata": {"gateway_request": request_id},
            "ttl_s": settings.request_timeout_s,
        }
        if priority is not None:
            updates["priority"] = priority
        job = job.model_copy(update=updates)
        size = len(encode_job(job))
        if size > MAX_JOB_BYTES:
            raise GatewayError(
                413,
                f"the job is {size / 2**20:.1f} MiB; a job is at most {MAX_JOB_BYTES // 2**20} MiB",
                code="request_too_large",
                param="messages" if row.messages is not None else "prompt",
            )
        num_prompt_tokens = count_prompt_tokens(row, tokenizer)
        _check_context(
            row, num_prompt_tokens, tokenizer.max_model_len if tokenizer else settings.max_model_len
        )
        echo_text = None
        if row.echo and isinstance(row.prompt, list):
            assert tokenizer is not None, "parse_row refuses token-id echo without a tokenizer"
            outside = [t for t in row.prompt if not 0 <= t < tokenizer.vocab_size]
            if outside:
                raise GatewayError(
                    400,
                    f"prompt token ids {outside[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})",
                    param="prompt",
                )
            echo_text = tokenizer.decode(row.prompt)
        rows.append(row)
        jobs.append(job)
        echo_texts.append(echo_text)
        counts.append(num_prompt_tokens)
        num_blocks += job_blocks(num_prompt_tokens, job.params.max_tokens, settings.block_size)
    return PreparedRequest(
        endpoint=endpoint,
        request_id=request_id,
        created=int(time.time()),
        rows=rows,
        jobs=jobs,
        echo_texts=echo_texts,
        num_prompt_tokens=counts,
        num_blocks=num_blocks,
        stream=stream,
        include_usage=include_usage,
    )
