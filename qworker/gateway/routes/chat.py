"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from qworker.gateway.generation import serve_generation
from qworker.openai.request_models import ChatCompletionRequest
from qworker.openai.rows import Endpoint

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions; the worker applies the model's chat template."""
    return await serve_generation(request, body.model_dump(exclude_unset=True), Endpoint.CHAT)
