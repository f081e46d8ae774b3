"""Jobs and results: the JSON that producers put on a queue and that consumers read back.

Validation lives here (pydantic) so that every source decodes a message the same way. Sampling
parameters are validated by the engine's own SamplingParams, so the rules live in one place. The
result models are defined in job_results.py and importable from here too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from qworker.engine.sampling_params import SamplingParams
from qworker.jobs.result import (
    CompletionResult,
    JobError,
    JobResult,
    JobStatus,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    completion_result,
    logprobs_dict,
    token_logprobs,
)
from qworker.utils import is_utf8_text

# The result side is defined in job_results.py and importable from here too.
__all__ = [
    "MAX_AFFINITY_BYTES",
    "MAX_JOB_BYTES",
    "MAX_JOB_ID_CHARS",
    "MAX_METADATA_DEPTH",
    "MAX_PRIORITY",
    "MAX_PROMPT_CHARS",
    "MIN_PRIORITY",
    "ChatMessage",
    "ChatRole",
    "CompletionResult",
    "FunctionDefinition",
    "Job",
    "JobDecodeError",
    "JobError",
    "JobResult",
    "JobStatus",
    "Timings",
    "TokenLogprob",
    "ToolCall",
    "ToolCallFunction",
    "ToolDefinition",
    "TopLogprob",
    "Usage",
    "affinity_problem",
    "completion_result",
    "decode_job",
    "derived_job_id",
    "derived_seed",
    "encode_job",
    "format_validation_error",
    "job_id_problem",
    "logprobs_dict",
    "resolve_job_id",
    "token_logprobs",
]

# A body past this size is failed before it is parsed: parsing and tokenizing megabytes would
# stall every running job for seconds, and no model here has a context anywhere near it.
MAX_JOB_BYTES = 2 * 2**20
# ~4 characters per token: far past the longest context we serve, still cheap to reject.
MAX_PROMPT_CHARS = 1_000_000
MAX_JOB_ID_CHARS = 256
# An affinity key names a lane's worth of jobs (qworker/jobs/affinity.py): a tenant, a task id.
MAX_AFFINITY_BYTES = 256
# Metadata comes back in the result as JSON: deeper nesting than this is refused at intake, because
# the result could not be written or read back (pydantic's JSON stops at a depth of about 200).
MAX_METADATA_DEPTH = 32
# Tools a job may show its chat template (OpenAI allows 128 functions per request).
MAX_TOOLS = 128
# A function's parameters schema, and chat_template_kwargs: nesting past these is refused.
MAX_TOOL_SCHEMA_DEPTH = 64
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_DEPTH = 8
MAX_TEMPLATE_KWARGS_BYTES = 16 * 2**10
# apply_chat_template's own arguments: chat_template_kwargs cannot set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
    }
)
# Priorities are compared in the scheduler only, but a producer in another language holds an int64.
MIN_PRIORITY = -(2**63)
MAX_PRIORITY = 2**63 - 1

# Namespace for ids derived from a message's queue identity when the producer gave none, so
# that a redelivered message maps to the same job id (and so to the same single result).
_JOB_ID_NAMESPACE = uuid.UUID("6f1b2c64-8d7e-4c55-9a0e-2f4a3b1c9d10")


# OpenAI's chat roles.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    # JSON text, as OpenAI sends it.
    arguments: str


class ToolCall(BaseModel):
    """A function call an assistant made earlier in the conversation (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """OpenAI's chat message: `content` is required except on an assistant message that made
    `tool_calls`; a `tool` message answers one call, named by `tool_call_id`."""

    model_config = ConfigDict(extra="forbid")

    role: ChatRole
    content: str | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is for assistant messages, not {self.role}")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDefinition(BaseModel):
    """OpenAI's function tool: `parameters` is a JSON Schema object (none: no arguments)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=65536)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema_is_json(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = None if value is None else _json_text_problem(value, MAX_TOOL_SCHEMA_DEPTH)
        if problem is not None:
            raise ValueError(f"parameters {problem}")
        return value


class ToolDefinition(BaseModel):
    """A tool the chat template shows the model (OpenAI's `{"type": "function", "function": ...}`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


def chat_template_kwargs_problem(value: dict[str, Any]) -> str | None:
    """Why `value` cannot be passed to a chat template (too many or reserved keys, not names,
    too deep or too large), or None."""
    if len(value) > MAX_TEMPLATE_KWARGS:
        return f"chat_template_kwargs has {len(value)} keys; the limit is {MAX_TEMPLATE_KWARGS}"
    for key in value:
        if not (isinstance(key, str) and key.isidentifier()):
            return f"chat_template_kwargs: {str(key)[:60]!r} is not a template variable name"
        if key in RESERVED_TEMPLATE_KWARGS:
            return f"chat_template_kwargs cannot set {key!r} (give it as its own field)"
    problem = _json_text_problem(value, MAX_TEMPLATE_KWARGS_DEPTH)
    if problem is not None:
        return f"chat_template_kwargs {problem}"
    size = len(json.dumps(value, separators=(",", ":")))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        return f"chat_template_kwargs is {size} bytes of JSON; the limit is {MAX_TEMPLATE_KWARGS_BYTES}"
    return None


def _json_kind(annotation: Any) -> str | None:
    """ "int", "float" or "bool" for a SamplingParams field of that scalar type (optional or not)."""
    origin = typing.get_origin(annotation)
    if origin is None:
        kinds = {annotation}
    elif origin in (typing.Union, types.UnionType):
        kinds = {arg for arg in typing.get_args(annotation) if arg is not type(None)}
        if len(kinds) == 1:  # optional: the kind of what it holds (allowed_token_ids)
            return _json_kind(next(iter(kinds)))
    elif origin is list and typing.get_args(annotation) == (int,):
        return "int list"
    else:  # strings or lists of strings: SamplingParams checks them
        return None
    for kind in (bool, int, float):
        if kinds == {kind}:
            return kind.__name__
    return None


_PARAM_KINDS = {
    name: kind
    for name, annotation in typing.get_type_hints(SamplingParams).items()
    if name in {f.name for f in dataclasses.fields(SamplingParams)}
    and (kind := _json_kind(annotation)) is not None
}


def _strict_type_problem(name: str, value: Any) -> str | None:
    """Why `value` is not of the JSON type of params field `name`; None when it is. pydantic
    would coerce "10" and true to 10 and 1: a producer that sends those has a bug to hear about."""
    kind = _PARAM_KINDS.get(name)
    if value is None or kind is None:
        return None
    if kind == "bool" and not isinstance(value, bool):
        return f"{name} must be true or false, got {value!r}"
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{name} must be an integer, got {value!r}"
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, int | float)):
        return f"{name} must be a number, got {value!r}"
    if kind == "int list" and not (
        isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return f"{name} must be a list of integers, got {value!r}"[:300]
    return None


class Job(BaseModel):
    """One generation job. Exactly one of `prompt`, `messages`, `prompt_token_ids` is given."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=MAX_JOB_ID_CHARS)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[StrictInt] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY, strict=True)
    lora: str | None = Field(
        default=None,
        strict=True,
        min_length=1,
        max_length=256,
        description="The LoRA adapter to generate with: a name from the worker's adapter list.",
    )
    affinity: str | None = Field(
        default=None,
        strict=True,
        description=(
            "Jobs with equal keys go to one lane of a queue with affinity lanes, so that the worker "
            "holding their prefix pulls them; without one, a key is derived from the prompt's start."
        ),
    )
    timeout_s: float | None = Field(
        default=None, gt=0, strict=True, description="Execution deadline, from when a worker takes the job."
    )
    ttl_s: float | None = Field(
        default=None,
        gt=0,
        strict=True,
        description="Longest time the job may wait in the queue before it first starts.",
    )
    metadata: dict[str, Any] | None = Field(default=None, description="Passed through to the result.")
    tools: list[ToolDefinition] | None = Field(
        default=None,
        max_length=MAX_TOOLS,
        description=(
            "Functions shown to the model (messages only): passed to the chat template as `tools` "
            "where it renders them, else written into a system message."
        ),
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description=('Variables for the chat template (messages only), e.g. {"enable_thinking": false}.'),
    )

    @field_validator("params", mode="before")
    @classmethod
    def _params_of_their_json_types(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for name, item in value.items():
                problem = _strict_type_problem(name, item)
                if problem is not None:
                    raise ValueError(problem)
        return value

    @field_validator("affinity")
    @classmethod
    def _affinity_is_a_key(cls, value: str | None) -> str | None:
        problem = None if value is None else affinity_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> Job:
        given = [
            name for name in ("prompt", "messages", "prompt_token_ids") if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of prompt, messages, prompt_token_ids"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty: give at least one {role, content} message")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.metadata is not None:
            problem = _json_text_problem(self.metadata, MAX_METADATA_DEPTH)
            if problem is not None:
                raise ValueError(f"metadata {problem}")
        for name in ("tools", "chat_template_kwargs"):
            if getattr(self, name) is not None and self.messages is None:
                raise ValueError(f"{name} is for chat jobs: give messages")
        if self.tools is not None:
            names = [t.function.name for t in self.tools]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"tools define {', '.join(twice)} more than once")
        if self.chat_template_kwargs is not None:
            problem = chat_template_kwargs_problem(self.chat_template_kwargs)
            if problem is not None:
                raise ValueError(problem)
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's dicts, without unset fields)."""
        if self.tools is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class JobDecodeError(Exception):
    """A message that is not a valid job. `error_type` goes into the failed result."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message


def _json_text_problem(value: Any, max_depth: int) -> str | None:
    """Why `value` (parsed JSON) cannot be written back as UTF-8 JSON, or None: nesting deeper than
    `max_depth`, or a string with a lone surrogate (JSON's \\ud800 escapes parse to one)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not is_utf8_text(item):
                return "holds a string that is not valid Unicode (a lone surrogate)"
        elif isinstance(item, (dict, list)):
            if depth > max_depth:
                return f"is nested more than {max_depth} levels deep"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


def affinity_problem(value: str) -> str | None:
    """Why `value` cannot be an affinity key (empty, too long, not valid Unicode), or None."""
    if not is_utf8_text(value):
        return "affinity is not valid Unicode (a lone surrogate)"
    size = len(value.encode())
    if size > MAX_AFFINITY_BYTES:
        return f"affinity is {size} bytes of UTF-8; the limit is {MAX_AFFINITY_BYTES}"
    if not value:
        return "affinity is empty: give a key, or leave it out to have one derived from the prompt"
    return None


def job_id_problem(job_id: str) -> str | None:
    """Why `job_id` cannot name a result (too long, not valid Unicode), or None."""
    if len(job_id) > MAX_JOB_ID_CHARS:
        return f"the job id is {len(job_id)} characters; the limit is {MAX_JOB_ID_CHARS}"
    if not is_utf8_text(job_id):
        return "the job id is not valid Unicode (a lone surrogate)"
    return None


def derived_seed(job_id: str) -> int:
    """The sampling seed of a job that gave none: every attempt of the job draws the same tokens
    (up to floating-point differences between batches), so a rerun after a redelivery streams
    the text that its readers already saw."""
    digest = hashlib.blake2b(job_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # within [0, 2**63)


def derived_job_id(queue_name: str, message_id: str) -> str:
    """A stable job id for a message whose producer gave none."""
    return str(uuid.uuid5(_JOB_ID_NAMESPACE, f"{queue_name}/{message_id}"))


def resolve_job_id(envelope_id: str | None, body: bytes, queue_name: str, message_id: str) -> str | None:
    """The id a message's result is stored under, or None when the message is too broken to know.

    The envelope's id (a stream field, a message attribute) wins; else the body's `id`; else, for a
    body that is a JSON object without one, an id derived from the message's queue identity.
    Never raises, whatever the bytes: an id that is too long or not valid Unicode is no id.
    """
    if envelope_id:
        return envelope_id if job_id_problem(envelope_id) is None else None
    if len(body) > MAX_JOB_BYTES:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    job_id = data.get("id")
    if job_id is None:
        return derived_job_id(queue_name, message_id)
    return job_id if isinstance(job_id, str) and job_id and job_id_problem(job_id) is None else None


def format_validation_error(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False):
        # Field names come from the input: an unknown one may be long.
        loc = ".".join(str(x)[:100] for x in item["loc"]) or "job"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            message = "unknown field"
        parts.append(f"{loc}: {message}")
    return "; ".join(parts)


def decode_job(body: bytes, job_id: str) -> Job:
    """Parse and validate a job body. `job_id` (from the envelope) is used when the body has none.

    Raises JobDecodeError with a message that says what to fix.
    """
    return job_of_fields(read_job_fields(body, job_id), job_id)


def read_job_fields(body: bytes, job_id: str) -> dict[str, Any]:
    """A job body's JSON object, with `job_id` as its id (any kind of job: pooling_job.py reads its
    `task`). Raises JobDecodeError: too large, not JSON, not an object, another id."""
    if len(body) > MAX_JOB_BYTES:
        raise JobDecodeError(
            "JobTooLarge",
            f"job body is {len(body) / 2**20:.1f} MiB; the limit is {MAX_JOB_BYTES // 2**20} MiB",
        )
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise JobDecodeError("InvalidJSON", f"job body is not valid JSON: {exc}") from None
    except RecursionError:
        raise JobDecodeError("InvalidJSON", "job body is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise JobDecodeError("ValidationError", f"a job must be a JSON object, got {type(data).__name__}")
    if "id" in data and data["id"] != job_id:
        raise JobDecodeError(
            "ValidationError", f"job id {data['id']!r} differs from its envelope id {job_id!r}"
        )
    return {**data, "id": job_id}


def job_of_fields(data: dict[str, Any], job_id: str) -> Job:
    """A generation job from `read_job_fields`' object (validated; a derived seed when sampled)."""
    try:
        job = Job.model_validate(data)
    except ValidationError as exc:
        raise JobDecodeError("ValidationError", format_validation_error(exc)) from None
    if job.params.seed is None and not job.params.is_greedy:
        job.params.seed = derived_seed(job_id)
    return job


def encode_job(job: Job) -> bytes:
    return job.model_dump_json(exclude_none=True).encode()
