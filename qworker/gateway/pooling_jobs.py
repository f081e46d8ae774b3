"""Pooling requests end to end: jobs (openai/pooling_requests.py) -> the context check ->
admission (backpressure) -> enqueue -> wait -> the jobs' results. A request that ends early (the
client goes away, the wait limit passes) cancels its jobs, as a generation request does.

No streaming: a pooling job's result is all there is. One gateway fronts one pool (one model):
a pool of embedding workers gets its own gateway (docs/pooling.md, "Fronting two pools").
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import anyio
from fastapi import Request

from qworker.gateway.errors import GatewayError
from qworker.gateway.responses import error_of
from qworker.gateway.state import GatewayState, check_model, gateway_state
from qworker.gateway.tokenizer import GatewayTokenizer
from qworker.jobs.job import MAX_JOB_BYTES, JobResult, JobStatus
from qworker.jobs.pooling_job import PoolingJob, encode_any_job
from qworker.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolingCall:
    """What a pooling route hands over: its jobs, and the names its response needs."""

    request_id: str
    created: int
    model: str


def check_inputs_fit(job: PoolingJob, tokenizer: GatewayTokenizer | None, max_model_len: int | None) -> int:
    """The job's prompt tokens (estimated at 4 characters a token without a tokenizer); 400
    naming the context length for an input that does not fit and is not truncated. A score
    job's pairs are formed by the worker's model (its template): the worker checks those."""
    if job.task == "score":
        texts = [job.query or "", *(job.documents or [])]
        return sum(cdiv(len(t), 4) for t in texts)
    total = 0
    for index, item in enumerate(job.inputs()):
        if isinstance(item, list):
            num_tokens = len(item)
        elif tokenizer is not None:
            num_tokens = len(tokenizer.encode(item))
        else:
            num_tokens = cdiv(len(item), 4)
        if job.truncate_prompt_tokens is not None:
            limit = max_model_len if job.truncate_prompt_tokens == -1 else job.truncate_prompt_tokens
            num_tokens = min(num_tokens, limit or num_tokens)
        elif (
            max_model_len is not None and num_tokens > max_model_len and (tokenizer or isinstance(item, list))
        ):
            where = "input" if isinstance(job.input, str) or len(job.inputs()) == 1 else f"input[{index}]"
            raise GatewayError(
                400,
                f"{where} is {num_tokens} tokens; this model's context is {max_model_len} tokens "
                "(set truncate_prompt_tokens to keep an input's last tokens)",
                code="context_length_exceeded",
                param="input",
            )
        total += num_tokens
    return total


def prepared_call(request: Request, model: object) -> tuple[GatewayState, PoolingCall]:
    state = gateway_state(request)
    check_model(state, model)
    name = model if isinstance(model, str) else state.settings.model
    return state, PoolingCall(uuid.uuid4().hex, int(time.time()), name)


async def run_pooling_jobs(
    request: Request, state: GatewayState, call: PoolingCall, jobs: list[PoolingJob]
) -> list[JobResult]:
    """Every job's completed result, in the order of `jobs`; GatewayError otherwise (a failed
    job's error as its status: 400 for a task the pool's model cannot do)."""
    tokenizer = await state.pool.call(state.tokenizer)
    max_model_len = tokenizer.max_model_len if tokenizer is not None else state.settings.max_model_len
    num_blocks = 0
    for job in jobs:
        num_tokens = await state.pool.call(check_inputs_fit, job, tokenizer, max_model_len)
        num_blocks += cdiv(num_tokens, state.settings.block_size) + job.num_inputs
    updates = {"metadata": {"gateway_request": call.request_id}, "ttl_s": state.settings.request_timeout_s}
    jobs = [job.model_copy(update=updates) for job in jobs]
    for job in jobs:
        size = len(encode_any_job(job))
        if size > MAX_JOB_BYTES:
            raise GatewayError(
                413,
                f"the job is {size / 2**20:.1f} MiB; a job is at most {MAX_JOB_BYTES // 2**20} MiB",
                code="request_too_large",
                param="input",
            )
    try:
        admission = state.gate.admit(num_blocks)
    except GatewayError as exc:
        state.metrics.rejected.labels(exc.code or "refused").inc()
        raise
    state.metrics.inflight_requests.inc()
    try:
        try:
            job_ids = await state.pool.call(state.pool.client.submit_many, jobs)
        except Exception as exc:
            logger.warning("enqueueing failed", exc_info=True)
            raise GatewayError(
                503, f"the queue did not take the job: {type(exc).__name__}", code="queue_unavailable"
            ) from None
        deadline = time.monotonic() + state.settings.request_timeout_s
        try:
            results = await state.pool.wait_results(job_ids, deadline, request)
        except TimeoutError:
            await _cancel(state, job_ids)
            raise GatewayError(
                504,
                f"no result within {state.settings.request_timeout_s:g}s (no worker took the job); "
                "the job was cancelled",
                code="timeout",
            ) from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _cancel(state, job_ids)
            raise
        if results is None:  # the client went away
            await _cancel(state, job_ids)
            raise GatewayError(499, "the client closed the request", code="client_closed_request")
    finally:
        state.metrics.inflight_requests.dec()
        admission.release()
    ordered = [results[job_id] for job_id in job_ids]
    for result in ordered:
        if result.status is not JobStatus.COMPLETED:
            raise error_of(result)
    return ordered


async def _cancel(state: GatewayState, job_ids: list[str]) -> None:
    try:
        await state.pool.cancel(job_ids)
    except Exception:
        logger.warning("cancelling %d job(s) failed", len(job_ids), exc_info=True)
