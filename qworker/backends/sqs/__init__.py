"""AWS SQS: the job queue (source.py, producer.py; large jobs go to S3 behind a pointer), its
backlog from the approximate counters (backlog.py) and its dead-letter queue (dead_letters.py).
Message layout and queue names: layout.py. SQS holds no results: pair it with s3:// or redis://."""

from __future__ import annotations

from qworker.backends import Backend, NotSupported, Requirement
from qworker.backends.sqs.backlog import open_backlog
from qworker.backends.sqs.dead_letters import open_dead_letters
from qworker.backends.sqs.producer import open_producer
from qworker.backends.sqs.source import open_source

BACKEND = Backend(
    name="sqs",
    open_source=open_source,
    open_producer=open_producer,
    open_sink=NotSupported("SQS is a queue, it cannot store results"),
    open_backlog=open_backlog,
    open_dead_letters=open_dead_letters,
    requires=(Requirement("boto3", "aws"),),
)
