"""Pooling responses as pydantic models: OpenAI's embeddings list, vLLM's score list, rerank
results (vLLM's shape, which its Cohere- and Jina-style routes share) and `/pooling` list. Plain
models (no imports of the row code), so that format.py's batch output line can carry an
embeddings body."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from qworker.jobs.result import JobResult


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolingUsage(_Strict):
    prompt_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, results: list[JobResult]) -> PoolingUsage:
        num_tokens = sum(r.usage.prompt_tokens for r in results)
        return cls(prompt_tokens=num_tokens, total_tokens=num_tokens)


class EmbeddingData(_Strict):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(_Strict):
    """OpenAI's `CreateEmbeddingResponse` (plus vLLM's id and created)."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreData(_Strict):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(_Strict):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(_Strict):
    text: str


class RerankResult(_Strict):
    index: int
    document: RerankDocument | None = Field(default=None, exclude_if=lambda v: v is None)
    relevance_score: float


class RerankResponse(_Strict):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


class PoolingData(_Strict):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class PoolingResponse(_Strict):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
