"""The gateway's ASGI app: create_app(settings, ...) mounts the routers, the error handlers and
the middleware (outermost first: metrics, API keys, body limit), and opens the pool.

More routes are more routers: pass `routers=[*DEFAULT_ROUTERS, my_router]`. Everything a router
needs is on `app.state.gateway` (state.GatewayState).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from qworker import __version__
from qworker.gateway.async_api.routes import batches, files, jobs
from qworker.gateway.auth import ApiKeyMiddleware
from qworker.gateway.backpressure import DemandGate
from qworker.gateway.dashboard import DashboardSettings, install_dashboard
from qworker.gateway.errors import install_error_handlers
from qworker.gateway.limits import BodyLimitMiddleware
from qworker.gateway.metrics import GatewayMetrics, MetricsMiddleware
from qworker.gateway.pool import Pool
from qworker.gateway.routes import chat, completions, health, models, pooling, tokenize
from qworker.gateway.settings import GatewaySettings
from qworker.gateway.state import GatewayState

logger = logging.getLogger(__name__)

DEFAULT_ROUTERS: tuple[APIRouter, ...] = (
    chat.router,
    completions.router,
    # issue 40: embeddings, score, rerank, pooling
    pooling.router,
    models.router,
    tokenize.router,
    health.router,
    # the Files, Batches and async-jobs API (gateway/async_api/)
    files.router,
    batches.router,
    jobs.router,
)
# Room for the multipart framing and form fields around an upload at the file-size limit.
MULTIPART_OVERHEAD_BYTES = 64 * 1024


def open_demand_gate(settings: GatewaySettings, queue_url: str | None) -> DemandGate:
    """The gate, with a reader of the queue's KV demand when a bound is set (the exporter's
    backlog readers: Redis Streams, Celery on Redis, SQS)."""
    reader = None
    if settings.max_waiting_blocks is not None:
        from qworker.backends.connections import resolve_url
        from qworker.pool.demand import PoolSizing
        from qworker.pool.exporter import open_pool_demand_reader

        reader = open_pool_demand_reader(resolve_url(queue_url), PoolSizing(block_size=settings.block_size))
    return DemandGate(
        reader=reader,
        max_waiting_blocks=settings.max_waiting_blocks,
        interval_s=settings.demand_interval_s,
        retry_after_s=settings.retry_after_s,
        max_inflight_requests=settings.max_inflight_requests,
    )


def create_app(
    settings: GatewaySettings,
    *,
    queue: str | None,
    results: str | None = None,
    stream_results: str | None = None,
    api_keys: frozenset[str] = frozenset(),
    routers: Sequence[APIRouter] = DEFAULT_ROUTERS,
    dashboard: DashboardSettings | None = None,
) -> FastAPI:
    """The app for the pool behind `queue` (URLs as `qworker worker` takes them). With `api_keys`,
    every route but /healthz and /readyz needs one. Connects lazily: no worker, and no request,
    is needed for it to start."""
    state = GatewayState(
        settings=settings,
        pool=Pool(queue, results, stream_results),
        gate=open_demand_gate(settings, queue),
        metrics=GatewayMetrics(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.gate.start()
        async_api.start()  # issue 23
        dashboard_service.start()  # issue 42
        try:
            yield
        finally:
            dashboard_service.close()  # issue 42
            async_api.close()  # issue 23
            state.gate.close()
            await state.pool.aclose()

    app = FastAPI(
        title="qworker gateway",
        version=__version__,
        summary="OpenAI-compatible HTTP front for a qworker pool",
        lifespan=lifespan,
    )
    app.state.gateway = state
    # -- issue 23: Files, Batches and async jobs (their state, the batch driver, webhooks) --
    from qworker.gateway.async_api.services import AsyncApi

    async_api = AsyncApi.open(settings, state.pool.client)
    app.state.async_api = async_api
    # --
    for router in routers:
        app.include_router(router)
    # issue 42: the pool's dashboard at /dashboard (gateway/dashboard/), behind the same keys.
    dashboard_service = install_dashboard(app, queue, state.pool.client.sink, dashboard)
    install_error_handlers(app)
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.max_body_bytes,
        # issue 23: uploads have their own limit, enforced while they stream (uploads.py).
        path_limits={"/v1/files": settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES},
    )
    app.add_middleware(ApiKeyMiddleware, keys=api_keys)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    return app
