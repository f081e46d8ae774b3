"""A job's stored result: its status, text and tokens, usage, timings, error and logprobs (the JSON
that consumers read back; docs/result.schema.json is generated from it)."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, Field, field_validator

from qworker.engine.outputs import CompletionOutput, Logprob, LogprobsDict
from qworker.utils import is_utf8_text


class JobStatus(str, Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"


class PromptTokensDetails(BaseModel):
    """OpenAI's `usage.prompt_tokens_details`."""

    # Prompt tokens whose KV came from a worker's prefix cache when the job was first scheduled
    # (vLLM's num_cached_tokens): 0 when nothing hit. Part of prompt_tokens, never more.
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class Timings(BaseModel):
    """Wall-clock times (Unix seconds). A stage the job never reached stays None."""

    enqueued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class JobError(BaseModel):
    type: str
    message: str

    @field_validator("type", "message")
    @classmethod
    def _storable(cls, text: str) -> str:
        # A message may quote the input (a field name, a value), which may hold a lone surrogate:
        # escaped here, so that the result can always be written as UTF-8 JSON.
        return text if is_utf8_text(text) else text.encode("utf-8", "backslashreplace").decode()


class TopLogprob(BaseModel):
    """One token at one position: its id, text, raw logprob (before temperature and any cut) and
    rank in the model's distribution (1 = most likely)."""

    token_id: int
    token: str | None = None
    logprob: float
    rank: int | None = None


class TokenLogprob(TopLogprob):
    """The token taken at one position (sampled, or the next prompt token) and the top-k
    alternatives there, most likely first."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class CompletionResult(BaseModel):
    """One of the n completions of a job (`params.n`)."""

    index: int
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


def token_logprobs(position: LogprobsDict, num_top: int) -> TokenLogprob:
    """The engine's {token id: Logprob} at one position (the taken token first, then the
    `num_top` alternatives) as JSON."""
    token_id, chosen = next(iter(position.items()))
    ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
    return TokenLogprob(
        token_id=token_id,
        token=chosen.decoded_token,
        logprob=chosen.logprob,
        rank=chosen.rank,
        top_logprobs=[
            TopLogprob(token_id=t, token=lp.decoded_token, logprob=lp.logprob, rank=lp.rank)
            for t, lp in ranked[:num_top]
            if (lp.rank or 0) <= num_top
        ],
    )


def logprobs_dict(position: TokenLogprob) -> LogprobsDict:
    """Back to the engine's shape: the taken token first, then the alternatives."""
    result: LogprobsDict = {position.token_id: Logprob(position.logprob, position.rank, position.token)}
    for top in position.top_logprobs:
        result.setdefault(top.token_id, Logprob(top.logprob, top.rank, top.token))
    return result


def completion_result(
    completion: CompletionOutput, finish_reason: str | None, num_top: int
) -> CompletionResult:
    return CompletionResult(
        index=completion.index,
        text=completion.text,
        token_ids=list(completion.token_ids),
        finish_reason=finish_reason,
        logprobs=(
            [token_logprobs(p, num_top) for p in completion.logprobs]
            if completion.logprobs is not None
            else None
        ),
    )


class PooledOutput(BaseModel):
    """One input's pooled output (a pooling job's, jobs/pooling_job.py): the embedding, the class
    probabilities (or logits), or the score as one value; floats, or base64 of little-endian
    float32 (the job's `encoding_format`). `index` is the input's place in the job."""

    index: int
    data: list[float] | str
    # The input's tokens (after truncate_prompt_tokens): its share of usage.prompt_tokens.
    num_prompt_tokens: int = 0


class JobResult(BaseModel):
    """The one stored outcome of a job.

    `text`, `token_ids`, `finish_reason` and `logprobs` are completion 0's; a job with
    `params.n > 1` also lists every completion in `outputs`. `prompt_logprobs` has one entry per
    prompt token (None for the first), and `prompt_token_ids` the tokens they score, when
    `params.prompt_logprobs` is set. A pooling job's vectors are in `pooled`, in input order
    (usage counts their prompt tokens; `text` and the token fields stay empty).
    """

    id: str
    status: JobStatus
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Set with prompt_logprobs: the tokens they score (the first has no logprob).
    prompt_token_ids: list[int] | None = None
    outputs: list[CompletionResult] | None = None
    pooled: list[PooledOutput] | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    error: JobError | None = None
    attempts: int = 1
    worker: str | None = None
    metadata: dict[str, Any] | None = None
