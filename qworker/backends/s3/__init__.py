"""AWS S3: a result store, one JSON object per job (results.py). It holds no queue."""

from __future__ import annotations

from qworker.backends import Backend, NotSupported, Requirement
from qworker.backends.s3.results import open_sink

_NOT_A_QUEUE = NotSupported("S3 stores results, it is not a job queue (use sqs:// for an AWS queue)")

BACKEND = Backend(
    name="s3",
    open_source=_NOT_A_QUEUE,
    open_producer=_NOT_A_QUEUE,
    open_sink=open_sink,
    open_backlog=_NOT_A_QUEUE,
    open_dead_letters=_NOT_A_QUEUE,
    requires=(Requirement("boto3", "aws"),),
)
