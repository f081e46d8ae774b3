"""A job's stored result, built from what the engine returned (if it ran) and the lease."""

from __future__ import annotations

import time

from qworker.backends.source import Lease
from qworker.engine.outputs import RequestOutput
from qworker.jobs.job import (
    JobError,
    JobResult,
    JobStatus,
    Timings,
    Usage,
    completion_result,
    token_logprobs,
)
from qworker.jobs.pooling_job import AnyJob, PoolingJob
from qworker.jobs.result import PromptTokensDetails
from qworker.worker.pooling import PoolingFanIn


def build_result(
    job_id: str,
    job: AnyJob | None,
    lease: Lease,
    status: JobStatus,
    error: JobError | None,
    output: RequestOutput | None,
    worker_name: str,
) -> JobResult:
    """`job` is None when the message could not be decoded; `output` is None when the job ended
    before the engine produced anything (bad input, expired, cancelled while queued)."""
    timings = Timings(enqueued_at=lease.enqueued_at, finished_at=time.time())
    result = JobResult(
        id=job_id,
        status=status,
        error=error,
        attempts=lease.delivery_count,
        worker=worker_name,
        metadata=job.metadata if job is not None else None,
        timings=timings,
    )
    if output is None or isinstance(job, PoolingJob):
        return result
    # A job stopped early (timeout, cancel, failure) ends with its status as the finish reason.
    completion = output.outputs[0]
    result.text = completion.text
    result.token_ids = list(completion.token_ids)
    result.finish_reason = completion.finish_reason if status is JobStatus.COMPLETED else status.value
    result.usage = Usage(
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=sum(len(c.token_ids) for c in output.outputs),
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )
    params = job.params if job is not None else None
    num_top = (params.logprobs or 0) if params is not None else 0
    if completion.logprobs is not None:
        result.logprobs = [token_logprobs(p, num_top) for p in completion.logprobs]
    if output.prompt_logprobs is not None:
        num_prompt_top = (params.prompt_logprobs or 0) if params is not None else 0
        result.prompt_logprobs = [
            token_logprobs(p, num_prompt_top) if p is not None else None for p in output.prompt_logprobs
        ]
        result.prompt_token_ids = list(output.prompt_token_ids)
    if params is not None and params.n > 1:
        result.outputs = [
            completion_result(c, c.finish_reason if status is JobStatus.COMPLETED else status.value, num_top)
            for c in output.outputs
        ]
    timings.started_at = output.metrics.first_scheduled_time
    timings.first_token_at = output.metrics.first_token_time
    timings.finished_at = output.metrics.finished_time or timings.finished_at
    return result


def build_pooling_result(
    job: PoolingJob,
    lease: Lease,
    status: JobStatus,
    error: JobError | None,
    fan_in: PoolingFanIn,
    worker_name: str,
) -> JobResult:
    """A pooling job's result: its inputs' vectors in input order (every input's when it
    completed; none when it ended otherwise), usage counting the prompt tokens pooled."""
    result = build_result(job.id, job, lease, status, error, None, worker_name)
    if status is JobStatus.COMPLETED:
        result.pooled = fan_in.pooled()
    result.usage = Usage(
        prompt_tokens=fan_in.num_prompt_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=fan_in.num_cached_tokens),
    )
    result.timings.started_at = fan_in.first_scheduled_at
    return result
