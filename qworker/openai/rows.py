"""One input row as a request: the endpoint, the prompt, SamplingParams keywords mapped from the
body's OpenAI names (and vLLM's extra ones), and what the output must show (echo, logprobs).

A row that cannot run as written raises RowError here, before anything reaches an engine or a
queue, with the HTTP status and OpenAI error code its output line gets.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from qworker.engine.sampling_params import MAX_TOKENS_LIMIT, SamplingParams
from qworker.errors import InvalidParamsError
from qworker.jobs.job import MAX_PROMPT_CHARS, affinity_problem, chat_template_kwargs_problem
from qworker.openai.batches.files import InputRow
from qworker.openai.chat_output import OutputParsing
from qworker.openai.format import CHAT_URL, COMPLETIONS_URL, SUPPORTED_URLS, RowError
from qworker.openai.structured_fields import ForcedTool, output_constraint
from qworker.openai.tool_parsers import HERMES, MISTRAL

# Row ids are uuid5(BATCH_NAMESPACE, "{batch_id}/{custom_id}"): the same row of the same batch is
# the same job on every run, so that a rerun finds what an earlier run stored.
BATCH_NAMESPACE = uuid.UUID("3c1f8e52-7a4b-4d2e-9b61-0d5a8c7e4f21")

# Body fields whose engine feature has not landed yet: a row that asks for one gets a 400 "not
# supported yet" line, never a silent default. n, logprobs and top_logprobs have landed.
PENDING_FIELDS: frozenset[str] = frozenset()

# OpenAI's completions default; a chat row without a limit runs to the end of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# OpenAI's bounds: top_logprobs 0-20 (chat); vLLM allows completions' logprobs up to 20 as well.
MAX_TOP_LOGPROBS = 20
# OpenAI's bound on completions per request.
MAX_N = 128

# Body fields mapped onto SamplingParams under the same name when given (not null).
PASSTHROUGH_FIELDS = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "truncate_prompt_tokens",
)
CHAT_FIELDS = frozenset(
    {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
    }
)
COMPLETION_FIELDS = frozenset({"prompt", "echo", "logprobs"})
# response_format and structured_outputs: structured_fields.py.
COMMON_FIELDS = frozenset(
    {
        "model",
        "stream",
        "n",
        "max_tokens",
        "response_format",
        "structured_outputs",
        "affinity",
        *PASSTHROUGH_FIELDS,
    }
)
# Accepted and without effect on what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "stream_options"})
# Features qworker does not have: accepted only at the value that means "off".
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "best_of": (None, 1),
}
# SamplingParams' fields: the names its error messages start with.
SAMPLING_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# OpenAI's chat roles, as the job schema has them (jobs.ChatRole).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


class Endpoint(str, Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"


ENDPOINT_OF_URL = {CHAT_URL: Endpoint.CHAT, COMPLETIONS_URL: Endpoint.COMPLETIONS}


def request_id_for(batch_id: str, custom_id: str) -> str:
    """The row's job id (pool mode) and response request_id: the same on every run of the batch."""
    return str(uuid.uuid5(BATCH_NAMESPACE, f"{batch_id}/{custom_id}"))


@dataclass(frozen=True)
class RowRequest:
    """A row that can run."""

    custom_id: str
    request_id: str
    endpoint: Endpoint
    # The name the row asked for (or the first served name): the body's `model`.
    model: str
    # Chat: the conversation ({role, content} with text content, and tool_calls / tool_call_id
    # where the message has them). Completions: the prompt.
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    # SamplingParams keywords, without max_tokens.
    sampling: dict[str, Any] = field(repr=False)
    # None: the row set no limit (chat: to the end of the context).
    max_tokens: int | None
    # Completions: the output text starts with the prompt's.
    echo: bool = False
    # Top alternatives to show per generated token; None: no logprobs.
    num_top_logprobs: int | None = None
    # Completions with echo and logprobs: the same for the prompt's tokens.
    num_prompt_logprobs: int | None = None
    # A forced tool call: the output is the call, reported as OpenAI's tool_calls.
    forced_tool: ForcedTool | None = None
    # Completions with echo and max_tokens 0: the response holds the prompt alone.
    is_scoring_only: bool = False
    # The job's affinity key (qworker/jobs/affinity.py); None: derived from the prompt.
    affinity: str | None = None
    # Chat: the tools shown to the model (the job's `tools`) and the template's own variables.
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Chat: what the output is read for (reasoning, tool calls: openai/chat_output.py).
    output_parsing: OutputParsing = field(default_factory=OutputParsing)
    # The LoRA adapter the row's `model` names; None: the base model.
    lora: str | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(**self.sampling, max_tokens=max_tokens)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise RowError(f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name)
    return value


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RowError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowError(f"{where}: only text content parts are supported, got {kind!r}", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise RowError(f"{where} must be a string or a list of text parts", param=where)


def _check_tool_message(message: dict[str, Any], where: str) -> None:
    """Tool fields in the job schema's shape (ChatMessage: tool_calls on assistant messages, a
    tool_call_id on tool messages), checked here so that local runs refuse what the pool would."""
    from pydantic import ValidationError

    from qworker.jobs.job import ChatMessage, format_validation_error

    try:
        ChatMessage.model_validate(message)
    except ValidationError as exc:
        raise RowError(f"{where}: {format_validation_error(exc)}", param=where) from None


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RowError("messages must be a non-empty list of {role, content} objects", param="messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RowError(f"{where} must be an object with role and content", param=where)
        unknown = sorted(set(message) - MESSAGE_FIELDS)
        if unknown:
            raise RowError(f"{where}: field(s) {', '.join(unknown)} are not supported", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RowError(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {str(role)[:50]!r}",
                param=f"{where}.role",
            )
        parsed: dict[str, Any] = {
            "role": role,
            "content": _text_content(message.get("content"), f"{where}.content"),
        }
        # Shapes are the job schema's to check (ChatMessage); the row only carries them.
        for name in ("tool_calls", "tool_call_id"):
            if message.get(name) is not None:
                parsed[name] = message[name]
        # content stays text ("" beside tool_calls, as OpenAI's null reads): every chat template
        # can render it, and the engine writes the calls in for templates that ignore tool_calls.
        if "tool_calls" in parsed or "tool_call_id" in parsed or role == "tool":
            _check_tool_message(parsed, where)
        messages.append(parsed)
    return messages


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def parse_prompt(value: Any) -> str | list[int]:
    """A completions prompt: a string or a list of token ids; a list holding one of those is
    that one prompt. Several prompts in one row are an error: give one row each."""
    if (
        isinstance(value, list)
        and len(value) == 1
        and (isinstance(value[0], str) or _is_token_list(value[0]))
    ):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise RowError("prompt is empty", param="prompt")
        if len(value) > MAX_PROMPT_CHARS:
            # A size limit, as a job over the queue's MAX_JOB_BYTES (chat's messages) is: 413 alike.
            raise RowError(
                f"prompt is {len(value)} characters; a prompt is at most {MAX_PROMPT_CHARS}",
                status_code=413,
                code="request_too_large",
                param="prompt",
            )
        return value
    if _is_token_list(value):
        return list(value)
    if (
        isinstance(value, list)
        and len(value) > 1
        and all(isinstance(v, str) or _is_token_list(v) for v in value)
    ):
        raise RowError(
            f"prompt holds {len(value)} prompts; a batch row takes one: give each its own row",
            param="prompt",
        )
    raise RowError("prompt must be a non-empty string or a list of token ids", param="prompt")


def check_fields(body: dict[str, Any], endpoint: Endpoint) -> None:
    """Unknown fields, and known features asked for at a value qworker cannot honour, are errors:
    nothing a row asks for is silently dropped."""
    own = CHAT_FIELDS if endpoint is Endpoint.CHAT else COMPLETION_FIELDS
    known = own | COMMON_FIELDS | IGNORED_FIELDS | set(NEUTRAL_VALUES)
    unknown = sorted(set(body) - known)
    if unknown:
        raise RowError(f"unknown field(s) for {endpoint.value}: {', '.join(unknown)}", param=unknown[0])
    for name, neutral in NEUTRAL_VALUES.items():
        if name in body and not any(body[name] == value for value in neutral):
            raise RowError(
                f"{name}={body[name]!r} is not supported", param=name, code="unsupported_parameter"
            )


def asked_pending_fields(body: dict[str, Any]) -> list[str]:
    """The fields of PENDING_FIELDS the row asks for (a value other than the one meaning "off")."""
    asked = []
    if body.get("n") not in (None, 1):
        asked.append("n")
    # Completions' logprobs=0 asks for the sampled token's logprob (and 0 == False in Python).
    if body.get("logprobs") is not None and body.get("logprobs") is not False:
        asked.append("logprobs")
    if body.get("top_logprobs") is not None:
        asked.append("top_logprobs")
    return [name for name in asked if name in PENDING_FIELDS]


@dataclass(frozen=True)
class MappedParams:
    """What sampling_kwargs reads from a body."""

    sampling: dict[str, Any]
    max_tokens: int | None
    num_top_logprobs: int | None
    num_prompt_logprobs: int | None
    # Completions with echo and max_tokens 0: score the prompt, generate nothing.
    is_scoring_only: bool = False


def sampling_kwargs(body: dict[str, Any], endpoint: Endpoint, echo: bool) -> MappedParams:
    """Map a body's OpenAI names onto SamplingParams' vLLM names, as vLLM's server does:
    max_completion_tokens (chat; else max_tokens) -> max_tokens; n -> n; chat's logprobs and
    top_logprobs -> logprobs (top_logprobs, or 0 for the sampled token alone); completions'
    logprobs -> logprobs, and with echo also prompt_logprobs. Value ranges of the rest are
    SamplingParams' own checks."""
    kwargs = {name: body[name] for name in PASSTHROUGH_FIELDS if body.get(name) is not None}
    stop = kwargs.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise RowError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    n = _optional_int(body, "n", 1, MAX_N)
    if n is not None and n != 1:
        kwargs["n"] = n
    num_top: int | None = None
    num_prompt: int | None = None
    max_tokens_field = "max_tokens"
    if endpoint is Endpoint.CHAT:
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        else:
            max_tokens_field = "max_completion_tokens"
        top_logprobs = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if _optional_bool(body, "logprobs"):
            num_top = top_logprobs or 0
            kwargs["logprobs"] = num_top
        elif top_logprobs:
            raise RowError("top_logprobs needs logprobs set to true", param="top_logprobs")
    else:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        num_top = _optional_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        if num_top is not None:
            kwargs["logprobs"] = num_top
            if echo:
                num_prompt = num_top
                kwargs["prompt_logprobs"] = num_top
    if endpoint is Endpoint.COMPLETIONS and echo and max_tokens == 0 and _is_int(max_tokens):
        # OpenAI allows it for scoring: the prompt (and its logprobs) back, nothing generated.
        # The engine always generates one token; the response leaves it out.
        return MappedParams(kwargs, 1, num_top, num_prompt, is_scoring_only=True)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise RowError(
            f"{max_tokens_field} must be a positive integer (0 only with echo, on completions), "
            f"got {max_tokens!r}",
            param=max_tokens_field,
        )
    return MappedParams(kwargs, max_tokens, num_top, num_prompt)


def param_of_sampling_error(message: str, body: dict[str, Any], endpoint: Endpoint) -> str | None:
    """The body field a SamplingParams check refused: its message starts with the SamplingParams
    name ("temperature must be >= 0"), spelled here as the body spelled it."""
    # "logit_bias[42] must be ..." names logit_bias.
    name = message.split(" ", 1)[0].split("[", 1)[0]
    if name == "max_tokens" and endpoint is Endpoint.CHAT and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    if name in ("logprobs", "prompt_logprobs"):
        return "top_logprobs" if endpoint is Endpoint.CHAT and "top_logprobs" in body else "logprobs"
    if name == "structured_outputs":
        return next((f for f in ("structured_outputs", "response_format", "tools") if f in body), name)
    return name if name in SAMPLING_PARAM_NAMES else None


def parse_row(
    custom_id: str,
    url: Any,
    body: Any,
    *,
    batch_id: str,
    served_model_names: Collection[str],
    echo_token_prompts: bool = False,
    adapter_names: Collection[str] = (),
    tool_call_parser: str | None = HERMES,
    reasoning_parser: str | None = None,
) -> RowRequest:
    """The row as a request, or RowError saying why it cannot run. `echo_token_prompts`: the
    caller can echo a token-id prompt (it has a tokenizer to decode it: the gateway).
    `adapter_names`: LoRA adapters served as model names beside `served_model_names` (a row
    whose `model` is one runs with that adapter). `tool_call_parser`: what reads calls under
    tool_choice "auto" (None: "auto" is refused); `reasoning_parser`: what splits reasoning off a
    chat output (openai/reasoning.py; None: nothing is)."""
    if url not in SUPPORTED_URLS:
        raise RowError(
            f"url {url!r} is not supported; use {' or '.join(SUPPORTED_URLS)}",
            code="invalid_url",
            param="url",
        )
    endpoint = ENDPOINT_OF_URL[url]
    if not isinstance(body, dict):
        raise RowError("body must be a JSON object", param="body")
    model = body.get("model")
    names = [*served_model_names, *(a for a in adapter_names if a not in served_model_names)]
    if model is None:
        model = names[0]
    elif model not in names:
        raise RowError(
            f"the model {model!r} does not exist here; this batch serves {', '.join(map(repr, names))}",
            status_code=404,
            code="model_not_found",
            param="model",
        )
    stream = body.get("stream")
    if stream not in (None, False):
        raise RowError("stream must be false (or absent) in a batch", param="stream")
    check_fields(body, endpoint)
    affinity = body.get("affinity")
    if affinity is not None:
        problem = affinity_problem(affinity) if isinstance(affinity, str) else "affinity must be a string"
        if problem is not None:
            raise RowError(problem, param="affinity")
    pending = asked_pending_fields(body)
    if pending:
        raise RowError(
            f"{', '.join(pending)} {'is' if len(pending) == 1 else 'are'} not supported yet",
            code="unsupported_parameter",
            param=pending[0],
        )
    messages = prompt = None
    echo = False
    if endpoint is Endpoint.CHAT:
        messages = parse_messages(body.get("messages"))
    else:
        prompt = parse_prompt(body.get("prompt"))
        echo = _optional_bool(body, "echo")
        if echo and not isinstance(prompt, str) and not echo_token_prompts:
            raise RowError("echo needs a text prompt", param="echo")
    mapped = sampling_kwargs(body, endpoint, echo)
    constraint = output_constraint(body, tool_call_parser)
    if constraint.structured_outputs is not None:
        mapped.sampling["structured_outputs"] = constraint.structured_outputs
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None:
        problem = (
            chat_template_kwargs_problem(template_kwargs)
            if isinstance(template_kwargs, dict)
            else "chat_template_kwargs must be an object"
        )
        if problem is not None:
            raise RowError(problem, param="chat_template_kwargs")
    tool_calling = constraint.tool_calling if messages is not None else None
    if (
        tool_calling is not None
        and tool_calling.parser == MISTRAL
        and body.get("skip_special_tokens") is None
    ):
        # [TOOL_CALLS] is a special token: kept in the text so that the parser sees it.
        mapped.sampling["skip_special_tokens"] = False
    try:
        # The value checks, now: a bad temperature fails this row before it reaches an engine.
        SamplingParams(**mapped.sampling, max_tokens=mapped.max_tokens or MAX_TOKENS_LIMIT)
    except InvalidParamsError as exc:
        raise RowError(str(exc), param=param_of_sampling_error(str(exc), body, endpoint)) from None
    except TypeError as exc:
        raise RowError(f"bad parameter: {exc}") from None
    return RowRequest(
        custom_id=custom_id,
        request_id=request_id_for(batch_id, custom_id),
        endpoint=endpoint,
        model=model,
        messages=messages,
        prompt=prompt,
        sampling=mapped.sampling,
        max_tokens=mapped.max_tokens,
        echo=echo,
        num_top_logprobs=mapped.num_top_logprobs,
        num_prompt_logprobs=mapped.num_prompt_logprobs,
        forced_tool=constraint.forced_tool,
        is_scoring_only=mapped.is_scoring_only,
        affinity=affinity,
        tools=constraint.tools if messages is not None else None,
        chat_template_kwargs=template_kwargs,
        output_parsing=OutputParsing(tool_calling, reasoning_parser if messages is not None else None),
        lora=model if model in adapter_names and model not in served_model_names else None,
    )


@dataclass(frozen=True)
class RowFailure:
    """A row that gets an error line without running."""

    custom_id: str
    request_id: str
    error: RowError


def prepare_rows(
    rows: Iterable[InputRow],
    *,
    batch_id: str,
    served_model_names: Collection[str],
    adapter_names: Collection[str] = (),
) -> Iterator[RowRequest | RowFailure]:
    """Each input row as a request, or as the failure its error line reports."""
    for row in rows:
        try:
            yield parse_row(
                row.custom_id,
                row.url,
                row.body,
                batch_id=batch_id,
                served_model_names=served_model_names,
                adapter_names=adapter_names,
            )
        except RowError as exc:
            yield RowFailure(row.custom_id, request_id_for(batch_id, row.custom_id), exc)
