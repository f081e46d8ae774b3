"""Pooling jobs: embed, classify or score inputs instead of generating (docs/pooling.md).

A pooling job is its own model beside the generation `Job`, told apart on the wire by its `task`
field (a generation job has none): the two share the envelope (id, priority, affinity, timeout_s,
ttl_s, metadata) and nothing else. A generation job's sampling parameters, messages, tools and
LoRA adapter mean nothing to a pooler, and a pooling job's `encoding_format`, `dimensions` and
`documents` nothing to a sampler; one model with both sets would need a rule per field saying
which task may set it, which two models say by their fields.

- `task: "embed"` or `"classify"`: `input` as OpenAI's embeddings take it, a string, a list of
  strings, a list of token ids, or a list of token-id lists. One vector per input.
- `task: "score"`: `query` and `documents`, one score per document (a cross-encoder pair, or the
  Qwen3-Reranker form: the worker's model decides, `LLMEngine.score_prompt`).

The result lists one `PooledOutput` per input (per document for score) in input order, with the
vector as floats or as base64 of little-endian float32 (`encoding_format`, as OpenAI's).
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator

from qworker.jobs.job import (
    MAX_JOB_ID_CHARS,
    MAX_METADATA_DEPTH,
    MAX_PRIORITY,
    MAX_PROMPT_CHARS,
    MIN_PRIORITY,
    Job,
    JobDecodeError,
    affinity_problem,
    format_validation_error,
    job_of_fields,
    read_job_fields,
)
from qworker.jobs.job import _json_text_problem as json_text_problem

__all__ = [
    "MAX_POOLING_INPUTS",
    "AnyJob",
    "EncodingFormat",
    "PoolingJob",
    "PoolingTask",
    "decode_any_job",
    "decode_vector",
    "encode_any_job",
    "encode_vector",
]

PoolingTask = Literal["embed", "classify", "score"]
EncodingFormat = Literal["float", "base64"]
# Inputs in one job (documents for score): OpenAI's limit for one embeddings request. Each input is
# one engine request; the worker packs them, so a larger job only takes longer to fail as a whole.
MAX_POOLING_INPUTS = 2048

PoolingInput = str | list[int]


class PoolingJob(BaseModel):
    """One pooling job: `input` for embed and classify, `query` and `documents` for score."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=MAX_JOB_ID_CHARS)
    task: PoolingTask
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = Field(
        default=None,
        description="embed, classify: a string, a list of strings, token ids, or a list of token-id lists",
    )
    query: StrictStr | None = Field(default=None, max_length=MAX_PROMPT_CHARS, description="score: the query")
    documents: list[StrictStr] | None = Field(
        default=None, description="score: the documents, one score each, in this order"
    )
    encoding_format: EncodingFormat = Field(
        default="float", description='"float": lists of numbers; "base64": little-endian float32, base64'
    )
    dimensions: int | None = Field(
        default=None,
        ge=1,
        strict=True,
        description="embed: keep the first `dimensions` values, then normalise (Matryoshka models)",
    )
    truncate_prompt_tokens: int | None = Field(
        default=None,
        ge=-1,
        strict=True,
        description="Keep each input's last this-many tokens; -1: as many as the context holds (vLLM's)",
    )
    normalize: bool | None = Field(
        default=None, strict=True, description="embed: L2-normalise (default: the model's pooler's default)"
    )
    use_activation: bool | None = Field(
        default=None,
        strict=True,
        description="classify, score: apply softmax / sigmoid (default true; false: raw logits)",
    )
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY, strict=True)
    affinity: str | None = Field(default=None, strict=True, description="As a generation job's")
    timeout_s: float | None = Field(default=None, gt=0, strict=True)
    ttl_s: float | None = Field(default=None, gt=0, strict=True)
    metadata: dict[str, Any] | None = Field(default=None, description="Passed through to the result.")

    @model_validator(mode="after")
    def _fields_of_the_task(self) -> PoolingJob:
        if self.task == "score":
            if self.input is not None:
                raise ValueError("input is for embed and classify: a score job gives query and documents")
            if self.query is None or self.documents is None:
                raise ValueError("a score job needs query and documents")
            if not self.query:
                raise ValueError("query is empty")
            if not self.documents:
                raise ValueError("documents is empty: give at least one")
            _check_count(len(self.documents), "documents")
            empty = [i for i, d in enumerate(self.documents) if not d]
            if empty:
                raise ValueError(f"documents[{empty[0]}] is empty")
        else:
            if self.query is not None or self.documents is not None:
                raise ValueError(f"query and documents are for score jobs, not {self.task}")
            if self.input is None:
                raise ValueError(f"{self.task} jobs need input")
            inputs = self.inputs()
            if not inputs:
                raise ValueError("input is empty: give a string, token ids, or a list of either")
            _check_count(len(inputs), "input")
            for index, item in enumerate(inputs):
                if not item:
                    where = "input" if isinstance(self.input, str) else f"input[{index}]"
                    raise ValueError(f"{where} is empty")
                if isinstance(item, str) and len(item) > MAX_PROMPT_CHARS:
                    raise ValueError(f"input[{index}] is over {MAX_PROMPT_CHARS} characters")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be a positive integer or -1")
        for name, tasks in (("dimensions", ("embed",)), ("normalize", ("embed",))):
            if getattr(self, name) is not None and self.task not in tasks:
                raise ValueError(f"{name} is for embed jobs, not {self.task}")
        if self.use_activation is not None and self.task == "embed":
            raise ValueError("use_activation is for classify and score jobs (embed has normalize)")
        if self.affinity is not None:
            problem = affinity_problem(self.affinity)
            if problem is not None:
                raise ValueError(problem)
        if self.metadata is not None:
            problem = json_text_problem(self.metadata, MAX_METADATA_DEPTH)
            if problem is not None:
                raise ValueError(f"metadata {problem}")
        return self

    def inputs(self) -> list[PoolingInput]:
        """Each input on its own, in order: a string, or a list of token ids (embed, classify)."""
        value = self.input
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(v, int) for v in value):
            return [list(value)]  # type: ignore[arg-type]  # one token-id list
        return list(value)  # type: ignore[arg-type]  # strings, or token-id lists

    @property
    def num_inputs(self) -> int:
        return len(self.documents or []) if self.task == "score" else len(self.inputs())


def _check_count(count: int, name: str) -> None:
    if count > MAX_POOLING_INPUTS:
        raise ValueError(f"{name} holds {count} items; the limit is {MAX_POOLING_INPUTS}")


AnyJob = Job | PoolingJob


def decode_any_job(body: bytes, job_id: str) -> AnyJob:
    """A generation job, or a pooling job when the body names a `task`. Raises JobDecodeError."""
    data = read_job_fields(body, job_id)
    if "task" not in data:
        return job_of_fields(data, job_id)
    try:
        return PoolingJob.model_validate(data)
    except ValidationError as exc:
        raise JobDecodeError("ValidationError", format_validation_error(exc)) from None


def encode_any_job(job: AnyJob) -> bytes:
    return job.model_dump_json(exclude_none=True).encode()


def encode_vector(values: list[float], encoding_format: EncodingFormat) -> list[float] | str:
    """The vector as floats, or as base64 of its little-endian float32 bytes (OpenAI's, vLLM's)."""
    if encoding_format == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def decode_vector(data: list[float] | str) -> list[float]:
    """The floats of `encode_vector`'s output, either form."""
    if isinstance(data, list):
        return data
    raw = base64.b64decode(data)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
