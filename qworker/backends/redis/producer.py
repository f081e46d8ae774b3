"""The sending side of a Redis Streams queue: XADD each job to its priority lane `{stream}:high`
when the job's priority is `high_lane_max_priority` or lower, else, with `affinity_lanes=L`, to the
lane its affinity key hashes to, else to the stream (lanes.py, docs/queues.md)."""

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
from qworker.backends.redis.lanes import QueueStreams
from qworker.backends.redis.queue_streams import ensure_groups, queue_lanes, queue_streams
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
        streams: QueueStreams | None = None,
    ):
        self.redis = redis
        self.durable = durable
        self.streams = streams or QueueStreams.of(stream, 1, cluster=False)
        self.stream = self.streams.stream
        self.group = group
        self.high_stream = self.streams.high
        # Jobs of this priority or lower go to the priority lane; None: none goes there.
        self.high_lane_max_priority = high_lane_max_priority
        # The groups exist before the first job, so that no job predates them unseen.
        ensure_groups(redis, self.streams.all, group)

    def _lane(self, job: OutgoingJob) -> str:
        limit = self.high_lane_max_priority
        return self.streams.for_job(job.affinity, is_urgent=limit is not None and job.priority <= limit)

    def send(self, jobs: list[OutgoingJob]) -> list[str]:
        lanes = [self._lane(job) for job in jobs]
        pipe = self.redis.pipeline(transaction=False)
        for job, lane in zip(jobs, lanes, strict=True):
            pipe.xadd(lane, {keys.FIELD_JOB_ID: job.job_id, keys.FIELD_BODY: job.body})
        entry_ids = pipe.execute()
        self.durable.wait(self.redis)
        return [self.streams.message_id(lane, as_text(x)) for x, lane in zip(entry_ids, lanes, strict=True)]

    def queue_depth(self) -> int | None:
        pipe = self.redis.pipeline(transaction=False)
        for stream in self.streams.all:
            pipe.xlen(stream)
        return sum(int(n) for n in pipe.execute())

    def close(self) -> None:
        self.redis.close()


def open_producer(url: str, payload_location: str | None) -> RedisStreamProducer:
    parsed = parse_redis_url(url)
    redis = redis_client(parsed.connection_url)
    stream, _ = queue_streams(url, parsed, redis)
    return RedisStreamProducer(
        redis,
        group=parsed.params.get("group", keys.DEFAULT_GROUP),
        high_lane_max_priority=url_integer(parsed.params, "high_lane_max_priority"),
        durable=durability(parsed),
        streams=queue_lanes(url, parsed, redis, stream),
    )
