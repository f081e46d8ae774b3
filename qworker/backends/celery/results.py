"""Results in Celery's Redis result-backend format, so that `AsyncResult(task_id).get()` works.

- `celery-task-meta-{task_id}` holds the JSON meta Celery's RedisBackend writes: `status`,
  `result`, `traceback`, `children`, `date_done`, `task_id`. A completed job is SUCCESS with the
  qworker result dict as `result`. A timed-out job is FAILURE with Celery's TimeLimitExceeded. A
  failed job is FAILURE with an exception Celery rebuilds by name (`exc_type` = the qworker
  error type, e.g. ValidationError; `exc_message` = the message), so `.get()` raises it; a
  cancelled job is REVOKED. The whole qworker result is
  also kept under `qworker_result` for readers that want it.
- Written with `SET NX EX` (the first writer wins: one result per task id), then PUBLISHed on the
  key's channel, where Celery's result consumer listens.
- Deltas, cancel flags and worker stats live in the same Redis under `prefix`, as in the Redis
  store, so `Client.stream` works on Celery jobs too.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from qworker.backends.celery import keys
from qworker.backends.celery.url import parse_celery_redis_url
from qworker.backends.redis import keys as redis_keys
from qworker.backends.redis.connection import redis_client
from qworker.backends.redis.results import RedisResultSink
from qworker.backends.urls import url_number
from qworker.jobs.job import JobResult, JobStatus


def task_meta(result: JobResult) -> dict[str, Any]:
    """Celery's result meta for a qworker result."""
    as_dict = result.model_dump(mode="json")
    meta: dict[str, Any] = {
        "task_id": result.id,
        "traceback": None,
        "children": [],
        "date_done": datetime.now(UTC).isoformat(),
    }
    if result.status is JobStatus.COMPLETED:
        meta.update(status="SUCCESS", result=as_dict)
        return meta
    exc: dict[str, Any]
    if result.status is JobStatus.CANCELLED:
        exc = {
            "exc_type": "TaskRevokedError",
            "exc_module": "celery.exceptions",
            "exc_message": ["cancelled"],
        }
        meta.update(status="REVOKED", result=exc)
    elif result.status is JobStatus.TIMEOUT:
        # What Celery stores for a task past its time_limit.
        message = result.error.message if result.error else "timeout"
        exc = {"exc_type": "TimeLimitExceeded", "exc_module": "celery.exceptions", "exc_message": [message]}
        meta.update(status="FAILURE", result=exc)
    else:
        error_type = result.error.type if result.error else result.status.value.capitalize()
        message = result.error.message if result.error else result.status.value
        # exc_module None: Celery makes an exception class of this name (it never imports one).
        exc = {"exc_type": error_type, "exc_module": None, "exc_message": [message]}
        meta.update(status="FAILURE", result=exc)
    meta["qworker_result"] = as_dict
    return meta


class CeleryResultSink(RedisResultSink):
    def __init__(self, redis: Any, *, result_ttl_s: int = redis_keys.DEFAULT_RESULT_TTL_S, **kwargs: Any):
        super().__init__(redis, result_ttl_s=result_ttl_s, **kwargs)

    @staticmethod
    def meta_key(job_id: str) -> str:
        return keys.task_meta_key(job_id)

    def _keys_of(self, job_id: str) -> list[str]:
        return [*super()._keys_of(job_id), self.meta_key(job_id)]

    def write_result(self, result: JobResult) -> bool:
        key = self.meta_key(result.id)
        payload = json.dumps(task_meta(result))
        is_stored = bool(self.redis.set(key, payload, nx=True, ex=self.result_ttl_s))
        if is_stored:
            self.redis.publish(key, payload)
        self.end_deltas(result.id, result.status.value)
        return is_stored

    def has_result(self, job_id: str) -> bool:
        # Not EXISTS: a Celery worker elsewhere may have left a PENDING or STARTED meta.
        return self.get_result(job_id) is not None

    def get_result(self, job_id: str) -> JobResult | None:
        raw = self.redis.get(self.meta_key(job_id))
        if raw is None:
            return None
        meta = json.loads(raw)
        if "qworker_result" in meta:
            return JobResult.model_validate(meta["qworker_result"])
        if meta.get("status") == "SUCCESS" and isinstance(meta.get("result"), dict):
            return JobResult.model_validate(meta["result"])
        return None  # a state another writer left (PENDING/STARTED from a Celery worker)


def open_sink(url: str) -> CeleryResultSink:
    redis_url, params = parse_celery_redis_url(url)
    return CeleryResultSink(
        redis_client(redis_url),
        result_ttl_s=int(url_number(params, "result_ttl_s", redis_keys.DEFAULT_RESULT_TTL_S)),
        prefix=params.get("prefix", redis_keys.DEFAULT_RESULT_PREFIX),
    )
