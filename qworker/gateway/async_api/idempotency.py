"""`Idempotency-Key` on POST /v1/batches and POST /v1/jobs, as Stripe and OpenAI define it: a retried
request with the same key (scoped to the API key and the route, kept 24 hours) gets the first
answer again; the same key with a different body gets 422. The record lives in the store, so a
retry that reaches another replica gets the same answer.

A record is written before the work starts (`SET NX`, holding the body's hash and no answer yet)
and completed with the answer after it: a retry that arrives while the first request is still
being served gets 409, and a first request that failed before answering drops its record so the
client can retry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from qworker.gateway.async_api.records import Records
from qworker.gateway.errors import GatewayError

IDEMPOTENCY_TTL_S = 24 * 3600
MAX_KEY_CHARS = 255


@dataclass(frozen=True)
class Replay:
    """The stored answer of the first request with this key."""

    status_code: int
    body: dict[str, Any]


def body_hash(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Idempotency:
    def __init__(self, records: Records) -> None:
        self.records = records

    def _key(self, owner: str, scope: str, key: str) -> str:
        return self.records.key("idem", owner, scope, hashlib.sha256(key.encode()).hexdigest())

    def begin(self, owner: str, scope: str, key: str, body: Any) -> Replay | None:
        """None: this request is the first with `key`, and must call finish() or abandon().
        A Replay: answer with it. GatewayError 422 (another body) or 409 (still running)."""
        if not key or len(key) > MAX_KEY_CHARS:
            raise GatewayError(
                400, f"Idempotency-Key must be 1-{MAX_KEY_CHARS} characters", param="Idempotency-Key"
            )
        digest = body_hash(body)
        redis_key = self._key(owner, scope, key)
        record = json.dumps({"body_hash": digest, "status_code": None, "body": None})
        if self.records.redis.set(redis_key, record, nx=True, ex=IDEMPOTENCY_TTL_S):
            return None
        raw = self.records.redis.get(redis_key)
        if raw is None:  # expired between the two calls: treat as first
            return self.begin(owner, scope, key, body)
        stored = json.loads(raw)
        if stored["body_hash"] != digest:
            raise GatewayError(
                422,
                "this Idempotency-Key was used with a different request body",
                code="idempotency_key_reused",
                param="Idempotency-Key",
            )
        if stored["status_code"] is None:
            raise GatewayError(
                409,
                "a request with this Idempotency-Key is still being served; retry later",
                code="idempotency_key_in_use",
            )
        return Replay(stored["status_code"], stored["body"])

    def finish(
        self, owner: str, scope: str, key: str, body: Any, status_code: int, answer: dict[str, Any]
    ) -> None:
        record = {"body_hash": body_hash(body), "status_code": status_code, "body": answer}
        self.records.redis.set(self._key(owner, scope, key), json.dumps(record), ex=IDEMPOTENCY_TTL_S)

    def abandon(self, owner: str, scope: str, key: str) -> None:
        self.records.redis.delete(self._key(owner, scope, key))
