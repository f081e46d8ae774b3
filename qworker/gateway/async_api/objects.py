"""OpenAI's `file` and `batch` objects as the gateway stores them (records.py), with their owner
beside them, never inside what a client sees.

A batch moves through OpenAI's statuses:

    validating -> in_progress -> finalizing -> completed
    validating -> failed                 (the input is not a batch file: `errors` names the lines)
    in_progress -> cancelling -> cancelled    (finished rows kept, the rest cancelled)
    in_progress -> expired               (past expires_at, with its partial output)
"""

from __future__ import annotations

import hashlib
import time
import uuid
from enum import Enum
from typing import Any

FILE_KIND = "file"
BATCH_KIND = "batch"
# What a batch was created with that its object does not show (output_expires_after).
BATCH_OPTIONS_KIND = "batch-options"
# OpenAI accepts only this window; it sets expires_at.
COMPLETION_WINDOWS = {"24h": 24 * 3600}
FILE_PURPOSES = frozenset({"batch", "batch_output", "fine-tune", "assistants", "user_data", "evals"})
UPLOAD_PURPOSES = frozenset({"batch", "user_data", "evals", "fine-tune", "assistants"})


class BatchStatus(str, Enum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL_STATUSES = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


# OpenAI's bounds of `expires_after.seconds` (files) and `output_expires_after.seconds` (batches).
MIN_EXPIRY_S = 3600
MAX_EXPIRY_S = 30 * 24 * 3600


def expiry_seconds(value: object, param: str) -> int:
    """`{"anchor": "created_at", "seconds": N}` as N; GatewayError 400 otherwise."""
    from qworker.gateway.errors import GatewayError

    if (
        not isinstance(value, dict)
        or value.get("anchor") != "created_at"
        or set(value) != {"anchor", "seconds"}
    ):
        raise GatewayError(400, f'{param} must be {{"anchor": "created_at", "seconds": N}}', param=param)
    seconds = value["seconds"]
    if isinstance(seconds, str) and seconds.isdigit():
        seconds = int(seconds)  # a multipart form field
    if (
        not isinstance(seconds, int)
        or isinstance(seconds, bool)
        or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S
    ):
        raise GatewayError(
            400, f"{param}.seconds must be an integer from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}", param=param
        )
    return seconds


def owner_of(api_key: bytes | None) -> str:
    """The owner id of a request: a digest of its API key (never the key), or "public" when the
    gateway has no keys."""
    if api_key is None:
        return "public"
    return hashlib.sha256(b"qworker-owner:" + api_key).hexdigest()[:32]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def file_object(
    file_id: str, filename: str, purpose: str, num_bytes: int, expires_after_s: int, now: int | None = None
) -> dict[str, Any]:
    created = int(now if now is not None else time.time())
    return {
        "id": file_id,
        "object": "file",
        "bytes": num_bytes,
        "created_at": created,
        "expires_at": created + expires_after_s,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(
    batch_id: str,
    endpoint: str,
    input_file_id: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    now: int | None = None,
    *,
    model: str | None = None,
) -> dict[str, Any]:
    created = int(now if now is not None else time.time())
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": completion_window,
        "status": BatchStatus.VALIDATING.value,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created,
        "in_progress_at": None,
        "expires_at": created + COMPLETION_WINDOWS[completion_window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
        # The model the pool serves; usage is summed from the output when the batch ends.
        "model": model,
        "usage": None,
    }


def is_terminal(batch: dict[str, Any]) -> bool:
    return BatchStatus(batch["status"]) in TERMINAL_STATUSES


def set_status(batch: dict[str, Any], status: BatchStatus, now: int | None = None) -> None:
    """The new status and its timestamp (in_progress_at, failed_at, ...)."""
    batch["status"] = status.value
    batch[f"{status.value}_at"] = int(now if now is not None else time.time())
