"""Async jobs in RunPod's shape: a job's record (owner, webhook, its delivery state) and its status
object, built from the result store:

    IN_QUEUE      no output yet            IN_PROGRESS   tokens are streaming
    COMPLETED     result completed         FAILED        result failed
    CANCELLED     result cancelled, or cancel asked and no result yet
    TIMED_OUT     result timeout
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from qworker.backends.sink import ResultSink
from qworker.gateway.async_api.records import Records
from qworker.gateway.async_api.webhooks import JOB_KIND
from qworker.jobs.job import JobResult, JobStatus

if TYPE_CHECKING:
    from qworker.backends.redis.results import RedisResultSink

RUNPOD_STATUS_OF = {
    JobStatus.COMPLETED: "COMPLETED",
    JobStatus.FAILED: "FAILED",
    JobStatus.CANCELLED: "CANCELLED",
    JobStatus.TIMEOUT: "TIMED_OUT",
}


def job_record(owner: str, webhook: str | None) -> dict[str, Any]:
    return {
        "owner": owner,
        "created_at": time.time(),
        "webhook": webhook,
        "webhook_status": "pending" if webhook else None,
        "webhook_attempts": 0,
        "cancel_requested": False,
    }


def delta_store(sink: ResultSink) -> RedisResultSink | None:
    """The Redis store that holds the job's live deltas, if there is one."""
    from qworker.backends.redis.results import RedisResultSink
    from qworker.backends.split_sink import SplitSink

    if isinstance(sink, SplitSink):
        return delta_store(sink.stream)
    if isinstance(sink, RedisResultSink):
        return sink
    return None


def is_streaming(sink: ResultSink, job_id: str) -> bool:
    store = delta_store(sink)
    # The store's own key for the job: on a Redis Cluster it carries the job's hash tag.
    return store is not None and bool(store.redis.exists(store.delta_key(job_id)))


def status_object(
    job_id: str, record: dict[str, Any], result: JobResult | None, is_running: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {"id": job_id}
    if result is not None:
        body["status"] = RUNPOD_STATUS_OF[result.status]
        body["output"] = result.model_dump(mode="json")
        if result.error is not None:
            body["error"] = f"{result.error.type}: {result.error.message}"
        timings = result.timings
        if timings.started_at is not None:
            body["delayTime"] = int(max(0.0, timings.started_at - record["created_at"]) * 1000)
            if timings.finished_at is not None:
                body["executionTime"] = int(max(0.0, timings.finished_at - timings.started_at) * 1000)
    elif record.get("cancel_requested"):
        body["status"] = "CANCELLED"
    else:
        body["status"] = "IN_PROGRESS" if is_running else "IN_QUEUE"
    if record.get("webhook"):
        body["webhook_status"] = record.get("webhook_status")
        body["webhook_attempts"] = record.get("webhook_attempts", 0)
        if record.get("webhook_error"):
            body["webhook_error"] = record["webhook_error"]
    return body


def final_status(records: Records, sink: ResultSink, job_id: str) -> dict[str, Any] | None:
    """The status object sent to the webhook: None while the job has no result."""
    record = records.get(JOB_KIND, job_id)
    result = sink.get_result(job_id)
    if record is None or result is None:
        return None
    body = status_object(job_id, record, result, False)
    for name in ("webhook_status", "webhook_attempts", "webhook_error"):
        body.pop(name, None)
    return body
