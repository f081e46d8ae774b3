"""The body-size limit (413), enforced while the body arrives: a declared Content-Length over the
limit is refused before a byte is read, and a chunked body is cut off once it passes the limit,
so the gateway never holds more than `max_body_bytes` of one request."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qworker.gateway.errors import GatewayError


def _too_large(limit: int) -> str:
    return f"the request body is over the limit of {limit} bytes"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # Paths with a limit of their own (issue 23: file uploads), checked instead of the default.
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_body_bytes)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                declared = int(value) if value.isdigit() else None
                error = None
                if declared is None:
                    error = GatewayError(
                        400, "the Content-Length header is not a number", code="invalid_content_length"
                    )
                elif declared > limit:
                    error = GatewayError(413, _too_large(limit), code="request_too_large")
                if error is not None:
                    await error.response()(scope, receive, send)
                    return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > limit:
                    # FastAPI passes an HTTPException raised while it reads the body on as it is
                    # (any other exception becomes its 400); errors.py gives 413 its code,
                    # request_too_large, as the Content-Length refusal above has.
                    raise HTTPException(413, _too_large(limit))
            return message

        await self.app(scope, limited_receive, send)
