"""GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from qworker.gateway.state import check_model, gateway_state

router = APIRouter(tags=["openai"])
# One creation time per process: a model object's `created` is stable while the gateway runs.
STARTED_AT = int(time.time())


def _model_card(name: str, base: str) -> dict[str, Any]:
    """OpenAI's model object; a LoRA adapter's says its base model in `parent`, as vLLM's does
    (the base model's `parent` is null)."""
    return {
        "id": name,
        "object": "model",
        "created": STARTED_AT,
        "owned_by": "qworker",
        "root": base,
        "parent": None if name == base else base,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    settings = gateway_state(request).settings
    return {
        "object": "list",
        "data": [_model_card(name, settings.model) for name in settings.served_model_names],
    }


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict[str, Any]:
    state = gateway_state(request)
    check_model(state, model)
    return _model_card(model, state.settings.model)
