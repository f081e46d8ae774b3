"""Async jobs, RunPod-shaped: POST /v1/jobs (the job JSON qworker's queues take, plus an optional
`webhook`) -> {id, status}; GET /v1/jobs/{id} (RunPod's statuses, the result when done);
GET /v1/jobs/{id}/stream (server-sent events); POST /v1/jobs/{id}/cancel. A job belongs to the
API key that submitted it; another key gets 404."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from qworker.gateway.async_api.jobs import is_streaming, job_record, status_object
from qworker.gateway.async_api.services import AsyncApi, async_api, request_owner
from qworker.gateway.async_api.webhooks import JOB_KIND, WEBHOOK_KIND
from qworker.gateway.errors import GatewayError
from qworker.gateway.pool import StreamEnd, StreamFailed, StreamText
from qworker.gateway.state import gateway_state
from qworker.jobs.job import Job, format_validation_error

router = APIRouter(tags=["jobs"])
IDEMPOTENCY_SCOPE = "POST /v1/jobs"


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object (a job)")
    return body


def _owned_record(api: AsyncApi, job_id: str, owner: str) -> dict[str, Any]:
    record = api.require_records().get(JOB_KIND, job_id)
    if record is None or record["owner"] != owner:
        raise GatewayError(404, f"no job with id {job_id!r}", code="job_not_found", param="job_id")
    return record


def _status(api: AsyncApi, job_id: str, owner: str) -> dict[str, Any]:
    record = _owned_record(api, job_id, owner)
    result = api.client.sink.get_result(job_id)
    running = result is None and is_streaming(api.client.sink, job_id)
    return status_object(job_id, record, result, running)


def _prepare(api: AsyncApi, owner: str, body: dict[str, Any]) -> tuple[Job, str | None]:
    body = dict(body)
    webhook = body.pop("webhook", None)
    if webhook is not None:
        if api.webhook_secret is None:
            raise GatewayError(
                400, "this gateway sends no webhooks (it has no --webhook-secret-file)", param="webhook"
            )
        api.webhook_policy.check(webhook)
    body.setdefault("id", str(uuid.uuid4()))
    try:
        job = Job.model_validate(body)
    except ValidationError as exc:
        raise GatewayError(400, format_validation_error(exc), code="invalid_job") from None
    assert job.id is not None, "the id was set above"
    records = api.require_records()
    existing = records.get(JOB_KIND, job.id)
    if existing is not None and existing["owner"] != owner:
        raise GatewayError(409, f"the job id {job.id!r} is taken", code="job_id_taken", param="id")
    records.put(JOB_KIND, job.id, job_record(owner, webhook))
    return job, webhook


async def _submit(api: AsyncApi, request: Request, owner: str, body: dict[str, Any]) -> dict[str, Any]:
    job, webhook = await anyio.to_thread.run_sync(_prepare, api, owner, body)
    state = gateway_state(request)
    await state.pool.submit([job])
    if webhook is not None:
        await anyio.to_thread.run_sync(api.require_records().activate, WEBHOOK_KIND, job.id)
    return {"id": job.id, "status": "IN_QUEUE"}


@router.post("/v1/jobs")
async def submit_job(request: Request) -> Any:
    api = async_api(request)
    api.require_records()
    owner = request_owner(request)
    body = await _json_body(request)
    key = request.headers.get("idempotency-key")
    if key is None:
        return await _submit(api, request, owner, body)
    idempotency = api.idempotency()
    replay = await anyio.to_thread.run_sync(idempotency.begin, owner, IDEMPOTENCY_SCOPE, key, body)
    if replay is not None:
        return JSONResponse(replay.body, status_code=replay.status_code)
    try:
        answer = await _submit(api, request, owner, body)
    except BaseException:
        await anyio.to_thread.run_sync(idempotency.abandon, owner, IDEMPOTENCY_SCOPE, key)
        raise
    await anyio.to_thread.run_sync(idempotency.finish, owner, IDEMPOTENCY_SCOPE, key, body, 200, answer)
    return answer


@router.get("/v1/jobs/{job_id}")
async def job_status(job_id: str, request: Request) -> dict[str, Any]:
    api = async_api(request)
    return await anyio.to_thread.run_sync(_status, api, job_id, request_owner(request))


@router.post("/v1/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    api = async_api(request)
    owner = request_owner(request)

    def cancel() -> dict[str, Any]:
        record = _owned_record(api, job_id, owner)
        if api.client.sink.get_result(job_id) is None:
            api.client.cancel(job_id)
            record["cancel_requested"] = True
            api.require_records().put(JOB_KIND, job_id, record)
        return _status(api, job_id, owner)

    return await anyio.to_thread.run_sync(cancel)


def _sse(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


@router.get("/v1/jobs/{job_id}/stream")
async def stream_job(job_id: str, request: Request) -> StreamingResponse:
    """Server-sent events: `data: {"id", "status": "IN_PROGRESS", "text"}` for each piece of text
    as the worker generates it, then `event: end` with the final status object."""
    api = async_api(request)
    owner = request_owner(request)
    await anyio.to_thread.run_sync(_owned_record, api, job_id, owner)
    state = gateway_state(request)
    timeout_s = state.settings.request_timeout_s

    async def events() -> AsyncIterator[bytes]:
        queue, stop = state.pool.open_streams([job_id], timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    yield _sse({"id": job_id, "error": "no result within the request timeout"}, "error")
                    return
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=min(left, 1.0))
                except asyncio.TimeoutError:
                    continue
                if isinstance(event, StreamText):
                    yield _sse({"id": job_id, "status": "IN_PROGRESS", "text": event.text})
                elif isinstance(event, StreamEnd):
                    yield _sse(await anyio.to_thread.run_sync(_status, api, job_id, owner), "end")
                    return
                elif isinstance(event, StreamFailed):
                    yield _sse({"id": job_id, "error": event.message}, "error")
                    return
        finally:
            stop.set()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
