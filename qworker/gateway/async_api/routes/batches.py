"""OpenAI's Batch API: POST /v1/batches, GET /v1/batches/{id}, GET /v1/batches (cursor `after`,
`limit`), POST /v1/batches/{id}/cancel. The gateway's batch driver (batch_driver.py) runs what is
created here; this module only reads and writes records."""

from __future__ import annotations

from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from qworker.gateway.async_api.batch_driver import cancel_flag_key
from qworker.gateway.async_api.objects import (
    BATCH_KIND,
    BATCH_OPTIONS_KIND,
    COMPLETION_WINDOWS,
    BatchStatus,
    batch_object,
    expiry_seconds,
    is_terminal,
    new_id,
    set_status,
)
from qworker.gateway.async_api.records import Records
from qworker.gateway.async_api.routes.files import owned_file
from qworker.gateway.async_api.services import async_api, request_owner
from qworker.gateway.errors import GatewayError
from qworker.openai.pooling_rows import BATCH_URLS

router = APIRouter(tags=["batches"])
IDEMPOTENCY_SCOPE = "POST /v1/batches"


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    output_expires_after: dict[str, Any] | None = None


def owned_batch(records: Records, batch_id: str, owner: str) -> dict[str, Any]:
    record = records.get(BATCH_KIND, batch_id)
    if record is None or record["owner"] != owner:
        raise GatewayError(404, f"no batch with id {batch_id!r}", code="batch_not_found", param="batch_id")
    batch: dict[str, Any] = record["batch"]
    # A cancel the driver has not seen yet (it stores its own copy between checks).
    if batch["status"] in ("validating", "in_progress") and records.redis.exists(
        cancel_flag_key(records, batch_id)
    ):
        batch["status"] = BatchStatus.CANCELLING.value
    return batch


def _create(records: Records, owner: str, body: CreateBatch, model: str) -> dict[str, Any]:
    if body.endpoint not in BATCH_URLS:
        raise GatewayError(
            400, f"endpoint must be one of {sorted(BATCH_URLS)}, got {body.endpoint!r}", param="endpoint"
        )
    if body.completion_window not in COMPLETION_WINDOWS:
        raise GatewayError(
            400, f"completion_window must be one of {sorted(COMPLETION_WINDOWS)}", param="completion_window"
        )
    input_file = owned_file(records, body.input_file_id, owner)
    if input_file["purpose"] != "batch":
        raise GatewayError(400, "the input file's purpose must be 'batch'", param="input_file_id")
    output_expiry_s = None
    if body.output_expires_after is not None:
        output_expiry_s = expiry_seconds(body.output_expires_after, "output_expires_after")
    batch = batch_object(
        new_id("batch"),
        body.endpoint,
        body.input_file_id,
        body.completion_window,
        body.metadata,
        model=model,
    )
    if output_expiry_s is not None:
        records.put(BATCH_OPTIONS_KIND, batch["id"], {"output_expiry_s": output_expiry_s})
    records.create(BATCH_KIND, batch["id"], owner, {"owner": owner, "batch": batch})
    records.activate(BATCH_KIND, batch["id"])
    return batch


@router.post("/v1/batches")
async def create_batch(body: CreateBatch, request: Request) -> Any:
    api = async_api(request)
    records = api.require_records()
    owner = request_owner(request)
    key = request.headers.get("idempotency-key")
    if key is None:
        return await anyio.to_thread.run_sync(_create, records, owner, body, api.settings.model)
    idempotency = api.idempotency()
    raw = body.model_dump(mode="json")
    replay = await anyio.to_thread.run_sync(idempotency.begin, owner, IDEMPOTENCY_SCOPE, key, raw)
    if replay is not None:
        return JSONResponse(replay.body, status_code=replay.status_code)
    try:
        batch = await anyio.to_thread.run_sync(_create, records, owner, body, api.settings.model)
    except BaseException:
        await anyio.to_thread.run_sync(idempotency.abandon, owner, IDEMPOTENCY_SCOPE, key)
        raise
    await anyio.to_thread.run_sync(idempotency.finish, owner, IDEMPOTENCY_SCOPE, key, raw, 200, batch)
    return batch


@router.get("/v1/batches")
async def list_batches(
    request: Request, after: str | None = None, limit: int = Query(default=20, ge=1, le=100)
) -> dict[str, Any]:
    api = async_api(request)
    records = api.require_records()
    owner = request_owner(request)
    ids, has_more = await anyio.to_thread.run_sync(records.page, BATCH_KIND, owner, after, limit)
    data = [await anyio.to_thread.run_sync(owned_batch, records, batch_id, owner) for batch_id in ids]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
    records = async_api(request).require_records()
    return await anyio.to_thread.run_sync(owned_batch, records, batch_id, request_owner(request))


def _cancel(records: Records, batch_id: str, owner: str) -> dict[str, Any]:
    batch = owned_batch(records, batch_id, owner)
    if batch["status"] in (BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value):
        return batch
    if is_terminal(batch) or batch["status"] == BatchStatus.FINALIZING.value:
        raise GatewayError(
            409, f"a batch that is {batch['status']} cannot be cancelled", code="batch_not_cancellable"
        )
    records.redis.set(cancel_flag_key(records, batch_id), b"1", ex=records.ttl_s)
    set_status(batch, BatchStatus.CANCELLING)
    records.put(BATCH_KIND, batch_id, {"owner": owner, "batch": batch})
    return batch


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    records = async_api(request).require_records()
    return await anyio.to_thread.run_sync(_cancel, records, batch_id, request_owner(request))
