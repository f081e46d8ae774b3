"""The dashboard's routes: one HTML page, its script and style (from the package: no CDN, no build
step), the JSON it polls, and two actions.

    GET  /dashboard                          the page (views: #/, #/batch/ID, #/job/ID, #/dead-letters)
    GET  /dashboard/static/{file}            dashboard.js, dashboard.css
    GET  /dashboard/api/session              the key's role, the CSRF token for actions, the refresh
    GET  /dashboard/api/overview             pool, queues, history, a page of batches, newest letters
    GET  /dashboard/api/batches/{id}         one batch and a page of its failed rows
    GET  /dashboard/api/jobs/{id}            one job: its result, or its stream so far
    GET  /dashboard/api/dead-letters         the newest dead letters
    POST /dashboard/api/dead-letters/replay  {"ids": [...]} or {"all": true}           admin + CSRF
    POST /dashboard/api/dead-letters/purge   {"confirm": "purge"}                      admin + CSRF

Actions need the admin role (403 otherwise), POST (405 otherwise), a JSON body, and the header
`X-CSRF-Token` with the session's token: HMAC-SHA256 of the request's key, so that every
replica computes the same one and a page of another origin cannot (it can neither read the
session nor send the header without a CORS preflight, which is refused). A request whose Origin
is another host is refused too. Every response forbids framing, and the page's
Content-Security-Policy allows scripts from this origin only: data is written with textContent,
never as HTML, and an id holding markup shows as text.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from qworker.gateway.auth import ADMIN, request_key, request_role
from qworker.gateway.errors import GatewayError

router = APIRouter(tags=["dashboard"], include_in_schema=False)

STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
CSRF_HEADER = "x-csrf-token"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _service(request: Request) -> Any:
    return request.app.state.dashboard


def csrf_token(key: bytes) -> str:
    return hmac.new(key, b"qworker-dashboard-csrf", hashlib.sha256).hexdigest()


def _static(name: str) -> bytes:
    return resources.files("qworker.gateway.dashboard").joinpath("static", name).read_bytes()


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers=SECURITY_HEADERS)


async def _call(request: Request, fn: Any, *args: Any) -> Any:
    return await anyio.to_thread.run_sync(fn, *args)


@router.get("/dashboard")
async def page() -> Response:
    return Response(_static("index.html"), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


@router.get("/dashboard/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC_FILES:
        raise GatewayError(404, f"no dashboard file {name!r}", code="not_found")
    return Response(
        _static(name),
        media_type=STATIC_FILES[name],
        headers={**SECURITY_HEADERS, "Cache-Control": "max-age=300"},
    )


@router.get("/dashboard/api/session")
async def session(request: Request) -> JSONResponse:
    role = request_role(request.scope)
    service = _service(request)
    return _json(
        {
            "role": role,
            "can_act": role == ADMIN,
            "csrf_token": csrf_token(request_key(request.scope)) if role == ADMIN else None,
            "refresh_ms": service.settings.refresh_ms,
        }
    )


@router.get("/dashboard/api/overview")
async def overview(
    request: Request,
    batch_offset: int = Query(0, ge=0),
    batch_limit: int = Query(20, ge=1, le=200),
    worker_offset: int = Query(0, ge=0),
    worker_limit: int = Query(50, ge=1, le=500),
) -> JSONResponse:
    service = _service(request)
    data = await _call(request, service.overview, batch_offset, batch_limit, worker_offset, worker_limit)
    return _json(data)


@router.get("/dashboard/api/batches/{batch_id:path}")
async def batch(
    request: Request, batch_id: str, offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500)
) -> JSONResponse:
    data = await _call(request, _service(request).batch, batch_id, offset, limit)
    if data is None:
        raise GatewayError(404, f"no batch {batch_id!r} in the result store", code="batch_not_found")
    return _json(data)


@router.get("/dashboard/api/jobs/{job_id:path}")
async def job(request: Request, job_id: str) -> JSONResponse:
    return _json(await _call(request, _service(request).job, job_id))


@router.get("/dashboard/api/dead-letters")
async def dead_letters(request: Request, limit: int = Query(50, ge=1, le=1000)) -> JSONResponse:
    return _json({"items": await _call(request, _service(request).dead_letters, limit)})


async def _action_body(request: Request) -> dict[str, Any]:
    """The checks every action makes before it reads its body: admin, same origin, CSRF, JSON."""
    if request_role(request.scope) != ADMIN:
        raise GatewayError(403, "dashboard actions need an admin key", code="permission_denied")
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise GatewayError(403, "a dashboard action from another origin", code="cross_origin")
    token = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(token.encode(), csrf_token(request_key(request.scope)).encode()):
        raise GatewayError(
            403, "missing or wrong X-CSRF-Token (GET /dashboard/api/session)", code="csrf_failed"
        )
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != "application/json":
        raise GatewayError(400, "an action's body is JSON", code="unsupported_content_type")
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise GatewayError(400, "the body is not JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the body is a JSON object", code="invalid_body")
    return body


@router.post("/dashboard/api/dead-letters/replay")
async def replay(request: Request) -> JSONResponse:
    body = await _action_body(request)
    ids = body.get("ids")
    if body.get("all") is True and ids is None:
        target = None
    elif isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids) and len(ids) <= 1000:
        target = ids
    else:
        raise GatewayError(400, 'give {"ids": [dead letter ids]} or {"all": true}', param="ids")
    return _json(await _call(request, _service(request).replay, target))


@router.post("/dashboard/api/dead-letters/purge")
async def purge(request: Request) -> JSONResponse:
    body = await _action_body(request)
    if body.get("confirm") != "purge":
        raise GatewayError(400, 'purging needs {"confirm": "purge"}', param="confirm")
    return _json(await _call(request, _service(request).purge))
