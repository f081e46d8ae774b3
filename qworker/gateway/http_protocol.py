"""uvicorn's h11 protocol with a deadline on a request's head, and a hard cap on open connections.

uvicorn times out an idle keep-alive connection (`timeout_keep_alive`) but not one whose request
line and headers never complete: a slowloris client that dribbles a header byte a second, or a
fresh connection that sends nothing, holds its socket and a slot of `limit_concurrency` forever.
Here every connection starts a timer when it opens and when the first bytes of a new request
arrive on a kept-alive connection; if h11 has not parsed a whole request head when it fires, the
client gets `408 Request Timeout` (OpenAI's error shape, `Connection: close`) and the socket is
closed. Bodies are not covered: once the head is in, the route reads the body under its own size
limit (limits.py), and a client that stops sending it is cut off by the request timeout.

uvicorn's own `limit_concurrency` only answers 503 to requests that arrive while too many
connections are open; the connections themselves are accepted and kept. Here a connection over
the limit gets the same 503 at once and is closed, so open sockets stay at most
`limit_concurrency` (+ the ones being refused) whatever the clients do.

Each request also finds an `asyncio.Event` in its scope's extensions (`DISCONNECT_EXTENSION`),
set when its client's connection is lost before the response completed: a route waiting for a
job waits on it beside the job (`disconnect_event`) instead of polling `Request.is_disconnected()`,
whose cancel scope cost the event loop most of its time with 2,000 waiting streams, and without
reading the ASGI receive channel, which a streaming response reads itself.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from qworker.gateway.settings import GatewaySettings

# The scope extension that holds a request's disconnect event (set by HeaderTimeoutProtocol).
DISCONNECT_EXTENSION = "qworker.disconnected"


def disconnect_event(scope: dict[str, Any]) -> asyncio.Event | None:
    """The event set when this request's client goes away; None under a server that is not
    HeaderTimeoutProtocol (then poll `Request.is_disconnected()`)."""
    return scope.get("extensions", {}).get(DISCONNECT_EXTENSION)


def _error_response(
    status: int, reason: bytes, message: str, error_type: str, code: str
) -> tuple[h11.Response, bytes]:
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}})
    data = body.encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"connection", b"close"),
    ]
    return h11.Response(status_code=status, headers=headers, reason=reason), data


class HeaderTimeoutProtocol(H11Protocol):
    """Set `header_timeout_s` on a subclass (`protocol_class`); uvicorn builds one per connection."""

    header_timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            self._refuse(
                503,
                b"Service Unavailable",
                "too many open connections; retry later",
                "overloaded",
                "too_many_connections",
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            gone = disconnect_event(self.cycle.scope)
            if gone is not None:
                gone.set()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        # A new request's task is created but has not run yet: its scope gets the event first.
        if self.cycle is not None and self.cycle is not cycle:
            self.cycle.scope.setdefault("extensions", {})[DISCONNECT_EXTENSION] = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        # h11 leaves IDLE for the client once it has parsed a whole request line and headers.
        if self.conn.their_state is h11.IDLE:
            if self._head_timer is None:
                self._arm_head_timer()  # a new request on a kept-alive connection has begun
        else:
            self._cancel_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        message = f"the request line and headers did not arrive within {self.header_timeout_s:g} s"
        self._refuse(408, b"Request Timeout", message, "timeout", "request_timeout")

    def _refuse(self, status: int, reason: bytes, message: str, error_type: str, code: str) -> None:
        response, data = _error_response(status, reason, message, error_type, code)
        try:
            output = self.conn.send(response) + (self.conn.send(h11.Data(data=data)) or b"")
            output += self.conn.send(h11.EndOfMessage()) or b""
            self.transport.write(output)
        except h11.LocalProtocolError:
            pass  # a response is under way on this connection already: just close it
        self.transport.close()


def protocol_class(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The class to pass as uvicorn's `http`, with its deadline on request heads."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})


def server_options(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn.Config keywords for the connection limits of `settings` (command.py, the tests)."""
    return {
        "http": protocol_class(settings.header_timeout_s),
        "limit_concurrency": settings.limit_concurrency,
        "timeout_keep_alive": settings.timeout_keep_alive_s,
        # A request head larger than this is a 400 (h11's own limit is 16 KiB).
        "h11_max_incomplete_event_size": 64 * 1024,
    }
