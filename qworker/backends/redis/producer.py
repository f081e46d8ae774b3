"""The sending side of a Redis Streams queue: XADD each job to the stream, or to its priority lane
`{stream}:high` when the job's priority is `high_lane_max_priority` or lower (docs/queues.md)."""

from __future__ import annotations

from typing import Any

from qworker.backends.redis import keys
from qworker.backends.redis.connection import (
    NO_WAIT,
    Durability,
    durability,
    parse_redis_url,
    redis_client,
)
from qworker.backends.redis.queue_streams import ensure_group, queue_streams
from qworker.backends.source import JobProducer, OutgoingJob
from qworker.backends.urls import url_integer
from qworker.utils import as_text


class RedisStreamProducer(JobProducer):
    def __init__(
        self,
        redis: Any,
        *,
        stream: str = keys.DEFAULT_STREAM,
        group: str = keys.DEFAULT_GROUP,
        high_lane_max_priority: int | None = None,
        durable: Durability = NO_WAIT,
    ):
        self.redis = redis
        self.durable = durable
        self.stream = stream
        self.group = group
        self.high_stream = keys.high_lane_stream(stream)
        # Jobs of this priority or lower go to the priority lane; None: every job to the stream.
        self.high_lane_max_priority = high_lane_max_priority
        # The groups exist before the first job, so that no job predates them unseen.
        for lane in (self.high_stream, stream):
            ensure_group(redis, lane, group)

    def _lane(self, job: OutgoingJob) -> str:
        limit = self.high_lane_max_priority
        return self.high_stream if limit is not None and job.priority <= limit else self.stream

    def send(self, jobs: list[OutgoingJob]) -> list[str]:
        lanes = [self._lane(job) for job in jobs]
        pipe = self.redis.pipeline(transaction=False)
        for job, lane in zip(jobs, lanes, strict=True):
            pipe.xadd(lane, {keys.FIELD_JOB_ID: job.job_id, keys.FIELD_BODY: job.body})
        entry_ids = pipe.execute()
        self.durable.wait(self.redis)
        return [
            keys.HIGH_LANE_PREFIX + as_text(x) if lane == self.high_stream else as_text(x)
            for x, lane in zip(entry_ids, lanes, strict=True)
        ]

    def queue_depth(self) -> int | None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(self.high_stream)
        pipe.xlen(self.stream)
        return sum(int(n) for n in pipe.execute())

    def close(self) -> None:
        self.redis.close()


def open_producer(url: str, payload_location: str | None) -> RedisStreamProducer:
    parsed = parse_redis_url(url)
    redis = redis_client(parsed.connection_url)
    stream, _ = queue_streams(url, parsed, redis)
    return RedisStreamProducer(
        redis,
        stream=stream,
        group=parsed.params.get("group", keys.DEFAULT_GROUP),
        high_lane_max_priority=url_integer(parsed.params, "high_lane_max_priority"),
        durable=durability(parsed),
    )
