"""The dead letters of a Redis Streams queue: the stream `{stream}:dead` (entry id = the dead
letter's id). Replay puts each back on the lane it came from."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qworker.backends.dead_letters import (
    DEFAULT_LIST_LIMIT,
    DeadLetter,
    DeadLetterQueue,
    clear_before_replay,
    with_replay_id,
)
from qworker.backends.redis import keys
from qworker.backends.redis.connection import (
    NO_WAIT,
    Durability,
    durability,
    key_layout,
    parse_redis_url,
    redis_client,
)
from qworker.backends.redis.lanes import QueueStreams
from qworker.backends.redis.queue_streams import queue_lanes, queue_streams
from qworker.backends.sink import ResultSink
from qworker.utils import as_text


class RedisStreamDeadLetters(DeadLetterQueue):
    def __init__(
        self,
        redis: Any,
        *,
        stream: str,
        dead_letter_stream: str,
        durable: Durability = NO_WAIT,
        streams: QueueStreams | None = None,
        cluster: bool = False,
    ) -> None:
        self.redis = redis
        self.durable = durable
        self.streams = streams or QueueStreams.of(stream, 1, cluster=cluster)
        self.cluster = cluster
        self.stream = stream
        self.dead_letter_stream = dead_letter_stream

    @staticmethod
    def letter_of_entry(entry_id: Any, fields: dict[Any, Any]) -> DeadLetter:
        """A dead-letter stream entry as a DeadLetter (the dashboard reads the newest itself)."""

        def text(name: str) -> str | None:
            value = fields.get(name.encode(), fields.get(name))
            if value is None:
                return None
            return value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)

        entry = as_text(entry_id)
        body = fields.get(keys.FIELD_BODY.encode(), fields.get(keys.FIELD_BODY, b""))
        return DeadLetter(
            id=entry,
            job_id=text(keys.FIELD_JOB_ID),
            reason=text("reason") or "",
            attempts=int(text("delivery_count") or 0),
            dead_at=int(entry.split("-")[0]) / 1000.0,
            body=body if isinstance(body, bytes) else str(body).encode(),
            source=text("source_stream"),
        )

    def read(self, limit: int = DEFAULT_LIST_LIMIT) -> list[DeadLetter]:
        entries = self.redis.xrange(self.dead_letter_stream, count=limit)
        return [self.letter_of_entry(entry_id, fields) for entry_id, fields in entries]

    def show(self, dead_letter_id: str) -> DeadLetter | None:
        import redis

        try:
            entries = self.redis.xrange(self.dead_letter_stream, dead_letter_id, dead_letter_id)
        except redis.ResponseError:  # not a stream entry id
            return None
        return self.letter_of_entry(*entries[0]) if entries else None

    def replay(self, dead_letter_ids: Iterable[str] | None, results: ResultSink | None) -> list[DeadLetter]:
        if dead_letter_ids is None:
            letters = self.read()
        else:
            letters = [d for d in (self.show(i) for i in dead_letter_ids) if d is not None]
        letters = [with_replay_id(letter) for letter in letters]
        for letter in letters:
            clear_before_replay(results, letter)
            fields: dict[str, Any] = {keys.FIELD_BODY: letter.body}
            if letter.job_id is not None:
                fields = {keys.FIELD_JOB_ID: letter.job_id, **fields}
            # Back to the lane it came from; anything else (a dead letter from an older stream
            # name or lane count) to the stream.
            target = letter.source if letter.source in self.streams.all else self.stream
            # On a cluster an affinity lane sits in another slot than the dead letters: the job
            # is written back first, then its letter deleted (a crash in between leaves the
            # letter to be replayed again, which replays the same job id: one result).
            in_one_slot = not (self.cluster and target in self.streams.lanes)
            pipe = self.redis.pipeline(transaction=in_one_slot)
            pipe.xadd(target, fields)
            if not in_one_slot:
                pipe.execute()
                pipe = self.redis.pipeline(transaction=True)
            pipe.xdel(self.dead_letter_stream, letter.id)
            pipe.execute()
            self.durable.wait(self.redis)
        return letters

    def purge(self) -> int:
        count = int(self.redis.xlen(self.dead_letter_stream))
        self.redis.delete(self.dead_letter_stream)
        return count

    def close(self) -> None:
        self.redis.close()


def open_dead_letters(url: str) -> RedisStreamDeadLetters:
    parsed = parse_redis_url(url)
    redis = redis_client(parsed.connection_url)
    stream, dead = queue_streams(url, parsed, redis)
    return RedisStreamDeadLetters(
        redis,
        stream=stream,
        dead_letter_stream=dead,
        durable=durability(parsed),
        streams=queue_lanes(url, parsed, redis, stream),
        cluster=key_layout(url).hash_tags,
    )
