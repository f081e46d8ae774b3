"""Bearer API keys: from `--api-key-file` (one key a line, `#` comments) or `$QWORKER_API_KEYS`
(comma-separated), never from argv. Keys are compared in constant time (hmac.compare_digest, each
key against the presented one, every key tried), so timing tells nothing about a key's prefix.

With keys set, every route needs `Authorization: Bearer KEY` except the probes in OPEN_PATHS.
Without keys, everything is open (a gateway behind a private network or a mesh that authenticates).

Roles (issue 42): a key may be followed by its role, after whitespace (`sk-abc read`; in
$QWORKER_API_KEYS the same, `sk-abc read,sk-def`):

    admin   everything: the API, the dashboard and its actions. A key without a role is admin, so
            the key files written before roles existed keep every right they had, plus the dashboard.
    read    the dashboard's pages and data and /metrics; no action, no API route (403)
    api     the API routes; not the dashboard (403)

The dashboard (DASHBOARD_PREFIX) also takes HTTP Basic auth with the key as the password, so that
a browser can open it (it asks for the key once); the API routes take only Bearer.
"""

from __future__ import annotations

import base64
import binascii
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

ADMIN, READ, API = "admin", "read", "api"
ROLES = (ADMIN, READ, API)
DEFAULT_ROLE = ADMIN
DASHBOARD_PREFIX = "/dashboard"
# Where a request's role is kept for the routes (scope["state"]).
ROLE_STATE_KEY = "qworker_role"
KEY_STATE_KEY = "qworker_key"


class ApiKeys(frozenset):  # type: ignore[type-arg]
    """The keys (a frozenset of str, as before roles) with each key's role in `roles`."""

    roles: dict[str, str]

    def __new__(cls, roles: Mapping[str, str]) -> ApiKeys:
        keys = super().__new__(cls, roles)
        keys.roles = dict(roles)
        return keys


def role_of(keys: frozenset[str], key: str) -> str:
    return getattr(keys, "roles", {}).get(key, DEFAULT_ROLE)


def request_role(scope: Scope) -> str:
    """The role the API key middleware found for this request (admin when keys are off)."""
    return str(scope.get("state", {}).get(ROLE_STATE_KEY, DEFAULT_ROLE))


def request_key(scope: Scope) -> bytes:
    """The key this request presented (b"" when keys are off)."""
    return bytes(scope.get("state", {}).get(KEY_STATE_KEY, b""))


class ApiKeyError(QworkerError, ValueError):
    """An API key source that cannot be used (unreadable, empty, a key with spaces)."""


def _checked(keys: Iterable[str], where: str) -> frozenset[str]:
    out = set()
    for key in keys:
        if any(c.isspace() for c in key) or not key.isascii() or not key.isprintable():
            raise ApiKeyError(f"an API key in {where} holds whitespace or non-printable characters")
        out.add(key)
    return frozenset(out)


def _parse_entry(entry: str, where: str) -> tuple[str, str]:
    """`KEY` or `KEY ROLE` -> (key, role)."""
    parts = entry.split()
    if len(parts) > 2:
        raise ApiKeyError(f"an entry in {where} has more than a key and a role")
    role = parts[1].lower() if len(parts) == 2 else DEFAULT_ROLE
    if role not in ROLES:
        raise ApiKeyError(f"an API key in {where} has the role {parts[1]!r}; roles: {', '.join(ROLES)}")
    return parts[0], role


def load_api_keys(path: Path | None = None, env: Mapping[str, str] | None = None) -> ApiKeys:
    """The keys of `path` and of $QWORKER_API_KEYS together, with their roles; empty: auth is off."""
    environ: Mapping[str, str] = os.environ if env is None else env
    roles: dict[str, str] = {}
    entries: list[tuple[list[str], str]] = []
    if path is not None:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ApiKeyError(f"cannot read the API key file {path}: {exc}") from None
        lines = [line.strip() for line in text.splitlines()]
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ApiKeyError(f"the API key file {path} holds no key")
        entries.append((from_file, str(path)))
    raw = environ.get(API_KEYS_ENV, "")
    entries.append(([k.strip() for k in raw.split(",") if k.strip()], f"${API_KEYS_ENV}"))
    for items, where in entries:
        parsed = [_parse_entry(item, where) for item in items]
        _checked([key for key, _ in parsed], where)
        for key, role in parsed:
            if roles.get(key, role) != role:
                raise ApiKeyError(f"an API key in {where} is given two roles")
            roles[key] = role
    return ApiKeys(roles)


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


def basic_password(scope: Scope) -> bytes | None:
    """The password of `Authorization: Basic base64(user:password)` (the dashboard's key)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() != b"basic":
                return None
            try:
                decoded = base64.b64decode(token.strip(), validate=True)
            except (binascii.Error, ValueError):
                return None
            _, sep, password = decoded.partition(b":")
            return password if sep and password else None
    return None


def _is_dashboard(path: str) -> bool:
    return path == DASHBOARD_PREFIX or path.startswith(DASHBOARD_PREFIX + "/")


def may_use(role: str, path: str) -> bool:
    """Whether a key of `role` may call `path` at all (the dashboard's actions check admin)."""
    if role == ADMIN:
        return True
    if role == READ:
        return _is_dashboard(path) or path == "/metrics"
    return not _is_dashboard(path)


class ApiKeyMiddleware:
    """Refuses (401, OpenAI's error shape) any request without a valid key, except OPEN_PATHS, and
    (403) a key whose role does not cover the route."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app = app
        self.keys = frozenset(k.encode() for k in keys)
        self.roles = [(k.encode(), role_of(keys, k)) for k in sorted(keys)]

    def _role(self, presented: bytes) -> str | None:
        """The role of the presented key; every key is compared, whatever matched."""
        found = None
        for key, role in self.roles:
            if hmac.compare_digest(presented, key):
                found = role
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if not self.keys:
            scope.setdefault("state", {})[ROLE_STATE_KEY] = ADMIN
            await self.app(scope, receive, send)
            return
        dashboard = _is_dashboard(path)
        token = bearer_token(scope)
        if token is None and dashboard:
            token = basic_password(scope)
        # A browser asks for the dashboard's key itself (Basic); API clients send Bearer.
        challenge = {"WWW-Authenticate": 'Basic realm="qworker dashboard"' if dashboard else "Bearer"}
        role = self._role(token) if token is not None else None
        if token is None:
            error = GatewayError(
                401,
                "no API key: send the header 'Authorization: Bearer YOUR_KEY'",
                code="missing_api_key",
                headers=challenge,
            )
        elif role is None:
            error = GatewayError(401, "the API key is not valid", code="invalid_api_key", headers=challenge)
        elif not may_use(role, path):
            error = GatewayError(
                403, f"this API key's role ({role}) does not cover {path}", code="permission_denied"
            )
        else:
            state = scope.setdefault("state", {})
            state[ROLE_STATE_KEY] = role
            state[KEY_STATE_KEY] = token
            await self.app(scope, receive, send)
            return
        await error.response()(scope, receive, send)
