from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Only for a pooled output's annotation: the worker and the gateway read these classes
    # without loading torch.
    import torch


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution (log_softmax of the logits
    before temperature, top-k, top-p and min-p), its rank in that distribution (1 is the most
    likely) and its text. As vLLM's Logprob with its default raw logprobs."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, the chosen token first, then the top-k alternatives by rank.
LogprobsDict = dict[int, Logprob]


@dataclass(frozen=True)
class RequestError:
    """Why the engine failed one request on its own (its grammar did not compile, say): the
    error's type name and a message for the user. The other requests run on."""

    type: str
    message: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # One dict per generated token when SamplingParams.logprobs is set.
    logprobs: list[LogprobsDict] | None = None


@dataclass
class RequestOutput:
    """The final (or current) state of one request, shaped like vLLM's RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache at the first scheduling (vLLM's
    # num_cached_tokens; OpenAI's usage.prompt_tokens_details.cached_tokens). 0 when none hit.
    num_cached_tokens: int = 0
    # One entry per prompt token when SamplingParams.prompt_logprobs is set; None for the first
    # token, which nothing predicts.
    prompt_logprobs: list[LogprobsDict | None] | None = None
    # Set when the engine failed this request alone; its outputs then hold what it made before.
    error: RequestError | None = None


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's PoolingOutput): 1-D float32 on the CPU, the embedding,
    the class probabilities (or logits), or the score as one element."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (embed, classify, score), as vLLM's PoolingRequestOutput."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool
    num_cached_tokens: int = 0
    error: RequestError | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    # Class probabilities (softmax; sigmoid for one label), or logits with use_activation=False.
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """LLM.classify's result per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """LLM.score's result per (query, document) pair (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    # Set when finished: the whole result (a PoolingRequestOutput for a pooling request, which
    # has no tokens and no text).
    output: RequestOutput | PoolingRequestOutput | None = field(default=None, repr=False)
