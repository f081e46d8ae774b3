"""`qworker dashboard`: the pool's dashboard alone, for a pool without a gateway.

    QWORKER_API_KEYS="sk-ops read,sk-admin" qworker dashboard --queue "redis://host:6379/0?stream=jobs"

The same page, JSON and actions as a gateway's /dashboard (routes.py), behind the same API keys
and roles (a key file with `KEY ROLE` lines, or $QWORKER_API_KEYS); nothing else is served but
/healthz. Like a gateway replica it keeps nothing of its own: several may run.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from qworker import envs
from qworker.cli_options import config_options
from qworker.gateway.dashboard.service import DashboardSettings

DEFAULT_PORT = 8001


def create_dashboard_app(
    queue: str | None,
    *,
    results: str | None = None,
    stream_results: str | None = None,
    api_keys: frozenset[str] = frozenset(),
    settings: DashboardSettings | None = None,
) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import RedirectResponse, Response

    from qworker import __version__
    from qworker.backends.connections import default_results_url, open_sink, resolve_url
    from qworker.gateway.auth import OPEN_PATHS, ApiKeyMiddleware
    from qworker.gateway.dashboard import install_dashboard
    from qworker.gateway.errors import install_error_handlers

    queue_url = resolve_url(queue)
    sink = open_sink(results or default_results_url(queue_url), stream_results)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.close()
            sink.close()

    app = FastAPI(
        title="qworker dashboard", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None
    )
    service = install_dashboard(app, queue_url, sink, settings)

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return RedirectResponse("/dashboard")

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        return Response(status_code=200)

    assert "/healthz" in OPEN_PATHS
    install_error_handlers(app)
    app.add_middleware(ApiKeyMiddleware, keys=api_keys)
    return app


@config_options(DashboardSettings, into="settings", panel="Dashboard")
def dashboard(
    queue: Annotated[
        str | None,
        typer.Option(envvar=envs.QWORKER_QUEUE_URL.name, help="The pool's queue URL (none: embedded Redis)"),
    ] = None,
    results: Annotated[
        str | None,
        typer.Option(envvar=envs.QWORKER_RESULTS_URL.name, help="Results URL (none: the queue server)"),
    ] = None,
    stream_results: Annotated[
        str | None, typer.Option(help="The delta store, when results are elsewhere (S3): a redis:// URL")
    ] = None,
    queue_url_file: Annotated[Path | None, typer.Option(help="Read the queue URL from this file")] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(help="API keys, one a line, each optionally followed by its role (admin, read, api)"),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to serve on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of /dashboard")] = DEFAULT_PORT,
    *,
    settings: DashboardSettings,
    log_level: Annotated[str, typer.Option(help="Root log level")] = "INFO",
) -> None:
    """Serve the pool's dashboard (workers, queues, batches, jobs, dead letters) without a gateway."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from qworker.cli_errors import connecting, reported_errors
    from qworker.gateway.command import _one_of, require_gateway_libraries

    with reported_errors():
        require_gateway_libraries()
    import uvicorn

    from qworker.gateway.auth import ApiKeyError, load_api_keys

    queue = _one_of(queue, queue_url_file, "--queue")
    try:
        keys = load_api_keys(api_key_file)
    except ApiKeyError as exc:
        raise typer.BadParameter(str(exc)) from None
    with reported_errors(), connecting("queue", queue):
        app = create_dashboard_app(
            queue, results=results, stream_results=stream_results, api_keys=keys, settings=settings
        )
    logging.getLogger("qworker.gateway").info(
        "dashboard on http://%s:%d/dashboard, %s", host, port, f"{len(keys)} API key(s)" if keys else "open"
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())
