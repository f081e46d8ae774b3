"""OpenAI's Files API: POST /v1/files (multipart, streamed into the file store), GET /v1/files,
GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}. A file belongs to the API
key that uploaded it (or, for batch output, created the batch); another key gets 404."""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from qworker.gateway.async_api.objects import FILE_KIND, UPLOAD_PURPOSES, expiry_seconds, file_object, new_id
from qworker.gateway.async_api.records import Records
from qworker.gateway.async_api.services import async_api, request_owner
from qworker.gateway.async_api.uploads import UploadLimits, receive_upload
from qworker.gateway.errors import GatewayError

router = APIRouter(tags=["files"])
MAX_LIST_LIMIT = 10_000


def owned_file(records: Records, file_id: str, owner: str) -> dict[str, Any]:
    """The file object, or 404 when it does not exist, has expired or is another key's."""
    record = records.get(FILE_KIND, file_id)
    if record is None or record["owner"] != owner or record["file"]["expires_at"] <= time.time():
        raise GatewayError(404, f"no file with id {file_id!r}", code="file_not_found", param="file_id")
    file: dict[str, Any] = record["file"]
    return file


@router.post("/v1/files")
async def create_file(request: Request) -> dict[str, Any]:
    api = async_api(request)
    records = api.require_records()
    owner = request_owner(request)
    file_id = new_id("file")
    writer = await anyio.to_thread.run_sync(api.files.writer, file_id)
    limits = UploadLimits(api.settings.max_file_bytes, api.settings.max_file_rows)
    try:
        upload = await receive_upload(request.stream(), request.headers.get("content-type"), writer, limits)
        purpose = upload.fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise GatewayError(
                400, f"purpose must be one of {sorted(UPLOAD_PURPOSES)}, got {purpose!r}", param="purpose"
            )
        expiry_s = api.settings.file_expiry_s
        if any(name.startswith("expires_after") for name in upload.fields):
            given = {
                "anchor": upload.fields.get("expires_after[anchor]"),
                "seconds": upload.fields.get("expires_after[seconds]"),
            }
            expiry_s = expiry_seconds(given, "expires_after")
        await anyio.to_thread.run_sync(writer.commit)
    except BaseException:
        await anyio.to_thread.run_sync(writer.abort)
        raise
    obj = file_object(file_id, upload.filename or "upload.jsonl", purpose, upload.num_bytes, expiry_s)
    await anyio.to_thread.run_sync(records.create, FILE_KIND, file_id, owner, {"owner": owner, "file": obj})
    return obj


@router.get("/v1/files")
async def list_files(
    request: Request,
    after: str | None = None,
    limit: int = Query(default=10_000, ge=1, le=MAX_LIST_LIMIT),
    purpose: str | None = None,
) -> dict[str, Any]:
    api = async_api(request)
    records = api.require_records()
    owner = request_owner(request)
    ids, has_more = await anyio.to_thread.run_sync(records.page, FILE_KIND, owner, after, limit)
    data = []
    now = time.time()
    for file_id in ids:
        record = await anyio.to_thread.run_sync(records.get, FILE_KIND, file_id)
        if record is None or record["file"]["expires_at"] <= now:
            continue
        if purpose is None or record["file"]["purpose"] == purpose:
            data.append(record["file"])
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    api = async_api(request)
    records = api.require_records()
    return await anyio.to_thread.run_sync(owned_file, records, file_id, request_owner(request))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    api = async_api(request)
    records = api.require_records()
    await anyio.to_thread.run_sync(owned_file, records, file_id, request_owner(request))
    return StreamingResponse(iterate_in_threadpool(api.files.read(file_id)), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    api = async_api(request)
    records = api.require_records()
    owner = request_owner(request)
    await anyio.to_thread.run_sync(owned_file, records, file_id, owner)
    await anyio.to_thread.run_sync(api.files.delete, file_id)
    await anyio.to_thread.run_sync(records.delete, FILE_KIND, file_id, owner)
    return {"id": file_id, "object": "file", "deleted": True}
