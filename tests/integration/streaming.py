"""What the redelivery tests share: a Redis client for a queue URL, and a `Client.stream` reader
in a thread."""

from __future__ import annotations

import threading

import redis as redis_lib

from qworker.backends.connections import SINK_PARAMS, SOURCE_PARAMS, parse_url
from qworker.jobs.client import Client


def raw_redis(url: str) -> redis_lib.Redis:
    return redis_lib.Redis.from_url(parse_url(url, SOURCE_PARAMS | SINK_PARAMS).connection_url)


class StreamReader(threading.Thread):
    """Client.stream(job_id) in a thread, from before the job starts until its result is stored."""

    def __init__(self, url: str, job_id: str, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.client = Client(queue=url)
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.chunks: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for text in self.client.stream(self.job_id, timeout=self.timeout_s):
                self.chunks.append(text)
        except BaseException as exc:
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(self.chunks)
