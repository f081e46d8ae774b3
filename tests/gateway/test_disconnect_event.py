"""The disconnect event of HeaderTimeoutProtocol: every request under `qworker gateway`'s server
options finds one in its scope, and it is set when the client goes away mid-request (what the
generation and pooling routes wait on instead of polling)."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from qworker.gateway.http_protocol import disconnect_event, server_options
from qworker.gateway.settings import GatewaySettings

from .conftest import serve_app


@pytest.mark.timeout(60)
def test_the_disconnect_event_is_in_the_scope_and_set_when_the_client_leaves():
    app = FastAPI()
    seen: dict[str, object] = {}
    entered, left = threading.Event(), threading.Event()

    @app.get("/has-event")
    async def has_event(request: Request) -> JSONResponse:
        gone = disconnect_event(request.scope)
        return JSONResponse({"event": gone is not None, "set": gone is not None and gone.is_set()})

    @app.get("/wait")
    async def wait(request: Request) -> JSONResponse:
        gone = disconnect_event(request.scope)
        assert gone is not None
        entered.set()
        try:
            await asyncio.wait_for(gone.wait(), timeout=30)
            seen["disconnected"] = True
        except TimeoutError:
            seen["disconnected"] = False
        left.set()
        return JSONResponse({})

    with serve_app(app, **server_options(GatewaySettings())) as served:
        host, port = served.url.removeprefix("http://").split(":")
        assert httpx.get(f"{served.url}/has-event").json() == {"event": True, "set": False}
        # Kept-alive connection, second request: a fresh event, not the first request's.
        with httpx.Client() as client:
            assert client.get(f"{served.url}/has-event").json() == {"event": True, "set": False}
            assert client.get(f"{served.url}/has-event").json() == {"event": True, "set": False}
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        assert entered.wait(10), "the request did not reach its route"
        sock.close()
        assert left.wait(10), "the route did not see the disconnect"
    assert seen["disconnected"] is True
