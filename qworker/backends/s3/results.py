"""Result store on S3: one JSON object per job at `s3://bucket/prefix/{id}.json`.

- Result: PutObject with `If-None-Match: *` (S3 conditional writes), so the first writer wins and
  a job that two workers ran (a lease lost during a stall) keeps exactly one result object. For a
  store without conditional writes (`?conditional_put=false`), the worker checks with HeadObject
  first and then puts: two workers finishing the same job within that window both write, and the
  later object replaces the earlier one (still one object per id; its content is the later run's).
- Deltas: S3 does not stream. `write_deltas` drops them and `read_deltas` waits for the result.
  So it keeps no progress either (`read_progress` is None): a job released or killed part-way
  starts from zero on its next attempt, unless `--stream-results` puts the deltas in Redis.
  To stream tokens, combine this store with a Redis one (`--stream-results redis://...`, see
  ../split_sink.py).
- Job notes: cancel flags are empty objects under `prefix/_cancel/` (one LIST per check finds
  them all); last errors and worker stats are not kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from qworker.backends.aws import aws_client, aws_parts
from qworker.backends.sink import Delta, ResultSink, wait_for_result
from qworker.backends.urls import url_flag
from qworker.jobs.job import JobResult

CANCEL_DIR = "_cancel"


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _status(exc: Exception) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


class S3ResultSink(ResultSink):
    def __init__(self, s3: Any, *, bucket: str, prefix: str = "", is_conditional_put: bool = True) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.is_conditional_put = is_conditional_put

    def key(self, job_id: str) -> str:
        return f"{self.prefix}/{job_id}.json" if self.prefix else f"{job_id}.json"

    def _cancel_dir(self) -> str:
        return f"{self.prefix}/{CANCEL_DIR}/" if self.prefix else f"{CANCEL_DIR}/"

    def write_deltas(self, deltas: list[Delta]) -> None:
        pass

    def write_result(self, result: JobResult) -> bool:
        from botocore.exceptions import ClientError

        args = dict(
            Bucket=self.bucket,
            Key=self.key(result.id),
            Body=result.model_dump_json().encode(),
            ContentType="application/json",
        )
        if not self.is_conditional_put:
            if self.has_result(result.id):
                return False
            self.s3.put_object(**args)
            return True
        try:
            self.s3.put_object(**args, IfNoneMatch="*")
        except ClientError as exc:
            # 412: the object exists. 409: a concurrent conditional put of the same key is in flight.
            if _status(exc) in (409, 412) or _error_code(exc) in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
            ):
                return False
            raise
        return True

    def has_result(self, job_id: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.s3.head_object(Bucket=self.bucket, Key=self.key(job_id))
        except ClientError as exc:
            if _status(exc) == 404 or _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def get_result(self, job_id: str) -> JobResult | None:
        from botocore.exceptions import ClientError

        try:
            reply = self.s3.get_object(Bucket=self.bucket, Key=self.key(job_id))
        except ClientError as exc:
            if _status(exc) == 404 or _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return JobResult.model_validate_json(reply["Body"].read())

    def read_deltas(self, job_id: str, timeout_s: float | None) -> Iterator[Delta]:
        return wait_for_result(self, job_id, timeout_s)

    def delete_result(self, job_id: str) -> None:
        # Nothing else of a job lives here: S3 keeps no deltas and no last errors.
        self.s3.delete_object(Bucket=self.bucket, Key=self.key(job_id))

    def request_cancel(self, job_id: str) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=self._cancel_dir() + job_id, Body=b"1")

    def cancelled_ids(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        wanted = set(job_ids)
        found: set[str] = set()
        cancel_dir = self._cancel_dir()
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=cancel_dir):
            for obj in page.get("Contents") or []:
                job_id = obj["Key"][len(cancel_dir) :]
                if job_id in wanted:
                    found.add(job_id)
        return found

    def close(self) -> None:
        self.s3.close()


def open_sink(url: str) -> S3ResultSink:
    bucket, path, params = aws_parts(url)
    return S3ResultSink(
        aws_client("s3", params),
        bucket=bucket,
        prefix=path,
        is_conditional_put=url_flag(params, "conditional_put", True),
    )
