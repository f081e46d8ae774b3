"""GET /healthz (liveness: the process serves), /readyz (readiness: the queue and the result store
answer) and /metrics (Prometheus text), as the worker names them; and GET /health, vLLM's liveness
route (200, empty body), for probes and load balancers written for vLLM."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from qworker.gateway.state import gateway_state

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_class=PlainTextResponse)
async def healthz() -> str:
    return "ok\n"


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/readyz", response_class=PlainTextResponse)
async def readyz(request: Request) -> Response:
    state = gateway_state(request)
    problem = await state.pool.call(state.pool.check_ready)
    if problem is not None:
        return PlainTextResponse(f"not ready: {problem}\n", status_code=503)
    return PlainTextResponse("ready\n")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = gateway_state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
