"""Bearer API keys: from `--api-key-file` (one key a line, `#` comments) or `$QWORKER_API_KEYS`
(comma-separated), never from argv. Keys are compared in constant time (hmac.compare_digest, each
key against the presented one, every key tried), so timing tells nothing about a key's prefix.

With keys set, every route needs `Authorization: Bearer KEY` except the probes in OPEN_PATHS.
Without keys, everything is open (a gateway behind a private network or a mesh that authenticates).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from qworker import envs
from qworker.errors import QworkerError
from qworker.gateway.errors import GatewayError

API_KEYS_ENV = envs.QWORKER_API_KEYS.name
# Liveness and readiness probes come from the orchestrator, which holds no key.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health"})


class ApiKeyError(QworkerError, ValueError):
    """An API key source that cannot be used (unreadable, empty, a key with spaces)."""


def _checked(keys: Iterable[str], where: str) -> frozenset[str]:
    out = set()
    for key in keys:
        if any(c.isspace() for c in key) or not key.isascii() or not key.isprintable():
            raise ApiKeyError(f"an API key in {where} holds whitespace or non-printable characters")
        out.add(key)
    return frozenset(out)


def load_api_keys(path: Path | None = None, env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The keys of `path` and of $QWORKER_API_KEYS together; empty: auth is off."""
    environ: Mapping[str, str] = os.environ if env is None else env
    keys: set[str] = set()
    if path is not None:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ApiKeyError(f"cannot read the API key file {path}: {exc}") from None
        lines = [line.strip() for line in text.splitlines()]
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ApiKeyError(f"the API key file {path} holds no key")
        keys |= _checked(from_file, str(path))
    raw = environ.get(API_KEYS_ENV, "")
    keys |= _checked([k.strip() for k in raw.split(",") if k.strip()], f"${API_KEYS_ENV}")
    return frozenset(keys)


def is_valid_key(presented: bytes, keys: frozenset[bytes]) -> bool:
    """Constant time in the presented key's content: every key is compared, whatever matched."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key)
    return found


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyMiddleware:
    """Refuses (401, OpenAI's error shape) any request without a valid key, except OPEN_PATHS."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app = app
        self.keys = frozenset(k.encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if token is None:
            error = GatewayError(
                401,
                "no API key: send the header 'Authorization: Bearer YOUR_KEY'",
                code="missing_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        elif not is_valid_key(token, self.keys):
            error = GatewayError(
                401,
                "the API key is not valid",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            await self.app(scope, receive, send)
            return
        await error.response()(scope, receive, send)
