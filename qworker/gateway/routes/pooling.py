"""The pooling routes: POST /v1/embeddings (OpenAI's), /v1/score and /score (vLLM's), /rerank,
/v1/rerank and /v2/rerank (vLLM's, which take the Cohere and Jina shapes), /pooling (vLLM's).

Each body becomes pooling jobs (openai/pooling_requests.py), runs on the pool's workers
(gateway/pooling_jobs.py) and is answered in its API's shape (openai/pooling_bodies.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request

from qworker.gateway.errors import GatewayError
from qworker.gateway.pooling_jobs import prepared_call, run_pooling_jobs
from qworker.openai.format import RowError
from qworker.openai.pooling_bodies import (
    embedding_response,
    pooling_response,
    rerank_response,
    score_response,
)
from qworker.openai.pooling_requests import embedding_job, pooling_job, rerank_job, score_jobs

router = APIRouter(tags=["pooling"])

JSON_BODY = Body(default=..., media_type="application/json")


def _parsed(parse: Any, body: Any) -> Any:
    try:
        return parse(body)
    except RowError as exc:
        raise GatewayError.from_row_error(exc) from None


def _model(body: Any) -> Any:
    return body.get("model") if isinstance(body, dict) else None


@router.post("/v1/embeddings")
async def create_embeddings(request: Request, body: dict[str, Any] = JSON_BODY) -> dict[str, Any]:
    """OpenAI's embeddings: `input` a string, strings, token ids or token-id lists; `encoding_format`
    float or base64 (little-endian float32); `dimensions`; vLLM's `truncate_prompt_tokens`, `normalize`."""
    state, call = prepared_call(request, _model(body))
    job = _parsed(embedding_job, body)
    (result,) = await run_pooling_jobs(request, state, call, [job])
    return embedding_response(call.request_id, call.created, call.model, result).model_dump(mode="json")


@router.post("/pooling")
async def create_pooling(request: Request, body: dict[str, Any] = JSON_BODY) -> dict[str, Any]:
    """vLLM's pooling route: embeddings' fields plus `task` (embed, classify) and `use_activation`."""
    state, call = prepared_call(request, _model(body))
    job = _parsed(pooling_job, body)
    (result,) = await run_pooling_jobs(request, state, call, [job])
    return pooling_response(call.request_id, call.created, call.model, result).model_dump(mode="json")


@router.post("/v1/score")
@router.post("/score")
async def create_score(request: Request, body: dict[str, Any] = JSON_BODY) -> dict[str, Any]:
    """vLLM's score: `text_1` (one, or one per pair) against `text_2`; one score per pair, in order."""
    state, call = prepared_call(request, _model(body))
    pairs = _parsed(score_jobs, body)
    results = await run_pooling_jobs(request, state, call, pairs.jobs)
    return score_response(call.request_id, call.created, call.model, pairs, results).model_dump(mode="json")


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def create_rerank(request: Request, body: dict[str, Any] = JSON_BODY) -> dict[str, Any]:
    """vLLM's rerank (Cohere's and Jina's shapes): `query`, `documents` (strings or {"text"}),
    `top_n`, `return_documents`; results by relevance, the best first."""
    state, call = prepared_call(request, _model(body))
    rerank = _parsed(rerank_job, body)
    (result,) = await run_pooling_jobs(request, state, call, [rerank.job])
    return rerank_response(call.request_id, call.model, rerank, result).model_dump(mode="json")
