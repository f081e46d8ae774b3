"""Pooling jobs' results as response bodies (pooling_format.py): OpenAI's embeddings list, vLLM's
score list, rerank results and `/pooling` list.

Vectors are passed through as the worker stored them: floats, or base64 of little-endian
float32 when the request asked for `encoding_format: "base64"` (what OpenAI's SDK asks for by
default, and decodes with numpy's float32).
"""

from __future__ import annotations

from qworker.jobs.pooling_job import decode_vector
from qworker.jobs.result import JobResult, PooledOutput
from qworker.openai.pooling_format import (
    EmbeddingData,
    EmbeddingResponse,
    PoolingData,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreResponse,
)
from qworker.openai.pooling_requests import RerankRequest, ScorePairs


def _pooled(result: JobResult) -> list[PooledOutput]:
    assert result.pooled is not None, f"job {result.id} completed without pooled outputs"
    return result.pooled


def _score(item: PooledOutput) -> float:
    return decode_vector(item.data)[0]


def embedding_response(request_id: str, created: int, model: str, result: JobResult) -> EmbeddingResponse:
    data = [EmbeddingData(index=p.index, embedding=p.data) for p in _pooled(result)]
    return EmbeddingResponse(
        id=f"embd-{request_id}", created=created, model=model, data=data, usage=PoolingUsage.of([result])
    )


def pooling_response(request_id: str, created: int, model: str, result: JobResult) -> PoolingResponse:
    data = [PoolingData(index=p.index, data=p.data) for p in _pooled(result)]
    return PoolingResponse(
        id=f"pool-{request_id}", created=created, model=model, data=data, usage=PoolingUsage.of([result])
    )


def score_response(
    request_id: str, created: int, model: str, pairs: ScorePairs, results: list[JobResult]
) -> ScoreResponse:
    """One score per (text_1, text_2) pair, in the body's order; `results` follow `pairs.jobs`."""
    data = [
        ScoreData(index=index, score=_score(_pooled(results[job])[document]))
        for index, (job, document) in enumerate(pairs.places)
    ]
    return ScoreResponse(
        id=f"score-{request_id}", created=created, model=model, data=data, usage=PoolingUsage.of(results)
    )


def rerank_response(request_id: str, model: str, rerank: RerankRequest, result: JobResult) -> RerankResponse:
    """The documents by relevance, the best first (ties: in the body's order), cut to top_n."""
    scored = sorted(_pooled(result), key=lambda p: (-_score(p), p.index))
    if rerank.top_n is not None:
        scored = scored[: rerank.top_n]
    results = [
        RerankResult(
            index=p.index,
            document=RerankDocument(text=rerank.documents[p.index]) if rerank.return_documents else None,
            relevance_score=_score(p),
        )
        for p in scored
    ]
    return RerankResponse(
        id=f"rerank-{request_id}", model=model, usage=PoolingUsage.of([result]), results=results
    )
