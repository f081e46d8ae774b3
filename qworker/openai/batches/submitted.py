"""The record of the rows a pool batch has enqueued, kept in the result store beside the rows'
results, so that every runner of the batch sees it: a rerun of `qworker batch --queue` on another
machine, and any gateway replica that carries a batch on after another was killed.

- Redis result store: a set `{prefix}:batch:{batch_id}:submitted` of job ids (SADD after each
  send), expiring with the results it points at.
- S3 result store: one object per send under `{prefix}/_batches/{batch_id}/submitted/`, holding
  that send's job ids one a line (S3 objects cannot be appended to; one LIST reads them all).
- A split store (results in S3, deltas in Redis): the final store's record.
- Any other store (memory, Celery): the journal file in the local work directory, as before.

The ids are loaded once when the record is opened: a 10,000-row batch is one SMEMBERS, not 10,000
round trips.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from qworker.backends.sink import ResultSink

# The record outlives the batch's results by nothing: results expire after a day by default.
SUBMITTED_TTL_S = 24 * 3600


class SubmittedRecord(Protocol):
    """The job ids a batch has enqueued."""

    def __contains__(self, job_id: object) -> bool: ...

    def add(self, job_ids: list[str]) -> None:
        """Record ids the queue took (durably, before the next send)."""

    def clear(self) -> None:
        """Forget every id (a run that starts the batch over)."""


class SubmittedJournal:
    """The job ids this batch has enqueued: one per line of a local file, appended (and synced)
    after each send."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ids: set[str] = set()
        if path.exists():
            with open(path, "rb") as f:
                # A last line without its newline was cut by a kill: not recorded.
                self.ids = {raw.decode().strip() for raw in f if raw.endswith(b"\n")}

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.ids

    def add(self, job_ids: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write("".join(f"{job_id}\n" for job_id in job_ids).encode())
            f.flush()
            os.fsync(f.fileno())
        self.ids.update(job_ids)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
        self.ids = set()


class RedisSubmitted:
    def __init__(self, redis: Any, key: str) -> None:
        self.redis = redis
        self.key = key
        self.ids: set[str] = {raw.decode() for raw in redis.smembers(key)}

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.ids

    def add(self, job_ids: list[str]) -> None:
        if not job_ids:
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.sadd(self.key, *job_ids)
        pipe.expire(self.key, SUBMITTED_TTL_S)
        pipe.execute()
        self.ids.update(job_ids)

    def clear(self) -> None:
        self.redis.delete(self.key)
        self.ids = set()


class S3Submitted:
    def __init__(self, s3: Any, bucket: str, prefix: str) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.prefix = prefix
        self.ids: set[str] = set()
        for key in self._keys():
            body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            self.ids.update(line for line in body.decode().splitlines() if line)

    def _keys(self) -> list[str]:
        keys: list[str] = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return keys

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.ids

    def add(self, job_ids: list[str]) -> None:
        if not job_ids:
            return
        body = "".join(f"{job_id}\n" for job_id in job_ids).encode()
        self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}{uuid.uuid4().hex}", Body=body)
        self.ids.update(job_ids)

    def clear(self) -> None:
        for key in self._keys():
            self.s3.delete_object(Bucket=self.bucket, Key=key)
        self.ids = set()


def open_submitted(sink: ResultSink, batch_id: str, fallback_path: Path) -> SubmittedRecord:
    """The batch's record in the result store `sink` when it has a place for one, else the
    journal file at `fallback_path`."""
    from qworker.backends.redis.results import RedisResultSink
    from qworker.backends.s3.results import S3ResultSink
    from qworker.backends.split_sink import SplitSink

    if isinstance(sink, SplitSink):
        return open_submitted(sink.final, batch_id, fallback_path)
    if isinstance(sink, RedisResultSink):
        return RedisSubmitted(sink.redis, f"{sink.prefix}:batch:{batch_id}:submitted")
    if isinstance(sink, S3ResultSink):
        base = f"{sink.prefix}/" if sink.prefix else ""
        return S3Submitted(sink.s3, sink.bucket, f"{base}_batches/{batch_id}/submitted/")
    return SubmittedJournal(fallback_path)
