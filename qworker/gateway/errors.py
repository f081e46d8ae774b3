"""OpenAI's error shape for every failure: `{"error": {"message", "type", "param", "code"}}` with
the HTTP status a client of OpenAI or vLLM expects. Anything a client sent gets a 4xx; a 500 means
a bug here, and says so without internals. `param` names the body field at fault (null when no
one field is: bad JSON, a body that is not an object, a size limit), and `code` is never null:
a raise without one gets its status's code (CODE_OF_STATUS).

    400 invalid_request_error  invalid_json: not JSON, or not UTF-8 (where, as line and column)
                               unsupported_content_type: a Content-Type other than application/json
                               invalid_body: no body, or JSON that is not an object
                               invalid_request_error: a field missing, mistyped, out of range, unknown
                               unsupported_parameter: a feature qworker lacks, asked for
                               context_length_exceeded: the prompt (+ max_tokens) past the context
    401 authentication_error   missing_api_key, invalid_api_key
    404 not_found_error        model_not_found (param: model), not_found (a route)
    405 invalid_request_error  method_not_allowed
    413 invalid_request_error  request_too_large: a body over --max-body-bytes, a job over the queue's
    429 rate_limit_error       backpressure, with Retry-After
    504 timeout_error          timeout: no result within --request-timeout-s (the job is cancelled)

A wrong Content-Type is a 400, not HTTP's 415: vLLM answers it with a 400 naming the media type,
and the openai SDK raises a 400 as BadRequestError, as it does every other unreadable body.
"""

from __future__ import annotations

import json
import logging
import re
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
# The code of an error raised without one.
CODE_OF_STATUS = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_content_type",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "cancelled",
    501: "not_supported",
    503: "service_unavailable",
    504: "timeout",
}
# What FastAPI says when it cannot read a body it expected as JSON (the cause: a UnicodeDecodeError).
_FASTAPI_PARSE_FAILURE = "There was an error parsing the body"
# pydantic's loc entries that name a member of a union ("str", "list[int]"), not a field.
_UNION_TAG = re.compile(
    r"^(str|int|float|bool|bytes|none|list|dict|tuple|set|literal|function-\w+)(\[.*\])?$"
)
_JSON_TYPE_NAMES = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "list": "an array",
    "dict": "an object",
    "NoneType": "null",
}


def error_type_of(status_code: int) -> str:
    return ERROR_TYPE_OF_STATUS.get(
        status_code, "server_error" if status_code >= 500 else "invalid_request_error"
    )


def error_code_of(status_code: int) -> str:
    return CODE_OF_STATUS.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")


class GatewayError(Exception):
    """A request that gets an error response: status, message, OpenAI code and param, and extra
    headers (Retry-After, WWW-Authenticate). Without a code, the status's (error_code_of)."""

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
        self.code = code or error_code_of(status_code)
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


def line_and_column(text: str | bytes, position: int) -> str:
    """`position` (0-based, into `text`) in words: 'line 1, column 30'."""
    newline: Any = b"\n" if isinstance(text, bytes) else "\n"
    line = text.count(newline, 0, position) + 1
    column = position - (text.rfind(newline, 0, position) + 1) + 1
    return f"line {line}, column {column}"


def _json_type(value: Any) -> str:
    return _JSON_TYPE_NAMES.get(type(value).__name__, type(value).__name__)


def _is_json_media_type(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """A field's path as rows.py spells it (`messages[0].role`), without pydantic's union tags."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _UNION_TAG.match(str(part)):
            param += ("." if param else "") + str(part)[:100]
    return param or None


def _json_invalid(exc: RequestValidationError, item: dict[str, Any]) -> GatewayError:
    loc = item.get("loc", ())
    position = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    reason = str(item.get("ctx", {}).get("error", "not JSON"))
    where = f" at {line_and_column(exc.body, position)}" if position is not None and exc.body else ""
    return GatewayError(400, f"the body is not valid JSON: {reason}{where}"[:2000], code="invalid_json")


def validation_error(exc: RequestValidationError, content_type: str | None) -> GatewayError:
    """FastAPI's RequestValidationError as one error: bad JSON, a body of the wrong content type or
    shape, or the fields at fault (the first named in `param`)."""
    items = list(exc.errors())
    for item in items:
        if item.get("type") == "json_invalid":
            return _json_invalid(exc, item)
    whole_body = [item for item in items if tuple(item.get("loc", ()))[1:] == ()]
    if whole_body:
        if whole_body[0].get("type") == "missing":
            return GatewayError(400, "the request has no body; send a JSON object", code="invalid_body")
        if content_type is None:
            return GatewayError(
                400,
                "the request has no Content-Type header; send the body as application/json",
                code="unsupported_content_type",
            )
        if not _is_json_media_type(content_type):
            return GatewayError(
                400,
                f"the body's Content-Type is {content_type[:100]!r}; this endpoint reads application/json",
                code="unsupported_content_type",
            )
        item = whole_body[0]
        return GatewayError(
            400, f"the body must be a JSON object, got {_json_type(item.get('input'))}", code="invalid_body"
        )
    # One message per field: the members of a union fail together (prompt: str | list[int] | ...).
    by_param: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        # loc starts with where the value came from ("body", "query").
        by_param.setdefault(_param_of(tuple(item.get("loc", ()))[1:]) or "body", []).append(item)
    parts = []
    for name, group in by_param.items():
        if group[0].get("type") == "missing":
            parts.append(f"{name} is required")
        elif len(group) > 1:
            parts.append(f"{name} has the wrong type: got {_json_type(group[0].get('input'))}")
        else:
            parts.append(f"{name}: {group[0].get('msg', 'invalid')}")
    return GatewayError(
        400,
        "; ".join(parts)[:2000] or "invalid request",
        code="invalid_request_error",
        param=next(iter(by_param), None),
    )


def _http_error(exc: StarletteHTTPException) -> GatewayError:
    headers = dict(exc.headers or {})
    if exc.status_code == 400 and exc.detail == _FASTAPI_PARSE_FAILURE:
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):
            where = line_and_column(cause.object, cause.start)
            byte = cause.object[cause.start]
            message = f"the body is not valid JSON: it is not UTF-8 (byte 0x{byte:02x} at {where})"
        elif isinstance(cause, json.JSONDecodeError):
            message = f"the body is not valid JSON: {cause.msg} at {line_and_column(cause.doc, cause.pos)}"
        else:
            message = "the body could not be read as JSON"
        return GatewayError(400, message, code="invalid_json", headers=headers)
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    return GatewayError(exc.status_code, message, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RowError)
    async def _row_error(request: Request, exc: RowError) -> JSONResponse:
        return GatewayError.from_row_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _http_error(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return GatewayError(500, "internal error in the gateway (logged)", code="server_error").response()
