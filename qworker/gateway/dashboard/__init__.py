"""The pool's dashboard (issue 42): a page at /dashboard on the gateway, or alone with
`qworker dashboard --queue URL` (command.py), behind the gateway's API keys and their roles
(auth.py: read keys see everything but actions).

routes.py (the page, its JSON, the actions), service.py (what they read and do, off the event
loop), static/ (index.html, dashboard.js, dashboard.css: written here, no library, no CDN, no
build step). It reads only the workers' stats reports, the queue and the result store
(qworker/pool/observer.py, batch_board.py, history.py), never a worker's internals.
"""

from __future__ import annotations

from typing import Any

from qworker.gateway.dashboard.service import DashboardService, DashboardSettings

__all__ = ["DashboardService", "DashboardSettings", "install_dashboard"]


def install_dashboard(
    app: Any, queue: str | None, sink: Any, settings: DashboardSettings | None = None
) -> Any:
    """Mount the dashboard's routes on `app` and return its service (start() and close() it with
    the app)."""
    from qworker.gateway.dashboard.routes import router

    service = DashboardService(queue, sink, settings)
    app.state.dashboard = service
    app.include_router(router)
    return service
