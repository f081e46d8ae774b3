"""OpenAI's error shape for every failure: `{"error": {"message", "type", "param", "code"}}` with
the HTTP status a client of OpenAI or vLLM expects. Anything a client sent gets a 4xx; a 500 means
a bug here, and says so without internals.

    400 invalid_request_error    a body that is not JSON, not UTF-8, not an object; a bad field
    401 authentication_error     no key, or a key that is not one of the gateway's
    404 not_found_error          an unknown model or route
    413 invalid_request_error    a body over --max-body-bytes (or a job over the queue's limit)
    429 rate_limit_error         backpressure, with Retry-After
    504 timeout_error            no result within --request-timeout-s (the job is cancelled)
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qworker.openai.format import ErrorBody, ErrorInfo, RowError

logger = logging.getLogger(__name__)

ERROR_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_type_of(status_code: int) -> str:
    return ERROR_TYPE_OF_STATUS.get(
        status_code, "server_error" if status_code >= 500 else "invalid_request_error"
    )


class GatewayError(Exception):
    """A request that gets an error response: status, message, OpenAI code and param, and extra
    headers (Retry-After, WWW-Authenticate)."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def from_row_error(cls, error: RowError) -> GatewayError:
        return cls(error.status_code, error.message, code=error.code, param=error.param)

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(
            message=self.message, type=error_type_of(self.status_code), param=self.param, code=self.code
        )
        return ErrorBody(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for item in exc.errors():
        # loc starts with where the value came from ("body", "query").
        loc = [str(x)[:100] for x in item.get("loc", ())][1:]
        if param is None and loc:
            param = ".".join(loc)
        parts.append(f"{'.'.join(loc) or 'body'}: {item.get('msg', 'invalid')}")
    return "; ".join(parts)[:2000] or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RowError)
    async def _row_error(request: Request, exc: RowError) -> JSONResponse:
        return GatewayError.from_row_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return GatewayError(400, message, code="invalid_request_error", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        code = "not_found" if exc.status_code == 404 else None
        return GatewayError(exc.status_code, message, code=code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return GatewayError(500, "internal error in the gateway (logged)", code="server_error").response()
