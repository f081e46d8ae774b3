"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from qworker.gateway.generation import serve_generation
from qworker.openai.request_models import CompletionRequest
from qworker.openai.rows import Endpoint

router = APIRouter(tags=["openai"])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's legacy completions: a prompt string, token ids, or a list of either (one job each)."""
    return await serve_generation(request, body.model_dump(exclude_unset=True), Endpoint.COMPLETIONS)
