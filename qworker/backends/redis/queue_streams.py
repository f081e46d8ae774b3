"""A queue URL's streams and their consumer group: the stream keys in the URL's key layout (a
cluster's hash tags included), and the group, created when missing (a Redis that restarted without
persistence has lost both; NOGROUP says so)."""

from __future__ import annotations

from typing import Any

from qworker.backends.redis import keys
from qworker.backends.redis.connection import key_layout
from qworker.backends.redis.lanes import QueueStreams
from qworker.backends.urls import InvalidURLError, ParsedURL, redact_url, url_integer


def is_no_group(exc: Exception) -> bool:
    """The stream or its consumer group does not exist (Redis restarted without persistence)."""
    import redis as redis_lib

    return isinstance(exc, redis_lib.ResponseError) and "NOGROUP" in str(exc)


def ensure_group(redis: Any, stream: str, group: str) -> None:
    """Create the stream and its consumer group if missing (from the start of the stream)."""
    import redis as redis_lib

    try:
        redis.xgroup_create(stream, group, id="0", mkstream=True)
    except redis_lib.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def ensure_groups(redis: Any, streams: tuple[str, ...], group: str) -> None:
    """ensure_group for many streams in one pipelined round trip (a queue with 256 lanes would
    otherwise take 258 at every open)."""
    import redis as redis_lib

    pipe = redis.pipeline(transaction=False)
    for stream in streams:
        pipe.xgroup_create(stream, group, id="0", mkstream=True)
    for reply in pipe.execute(raise_on_error=False):
        if isinstance(reply, redis_lib.ResponseError) and "BUSYGROUP" in str(reply):
            continue
        if isinstance(reply, Exception):
            raise reply


def queue_streams(url: str, parsed: ParsedURL, redis: Any) -> tuple[str, str]:
    """(stream key, dead-letter stream key) of a queue URL, in the URL's key layout. On a
    cluster the stream's name becomes its hash tag, and an InvalidURLError of one line says so
    when the server still holds the single-server layout's stream, or when a dead_letter stream
    the URL names would sit in another slot."""
    name = parsed.params.get("stream", keys.DEFAULT_STREAM)
    stream = key_layout(url).stream(name)
    dead = parsed.params.get("dead_letter", keys.dead_letter_stream(stream))
    if stream == name:
        return stream, dead
    from redis.crc import key_slot

    old = [key for key in (name, keys.high_lane_stream(name)) if redis.exists(key)]
    if old:
        raise InvalidURLError(
            f"the cluster at {redact_url(url)!r} holds {old[0]!r}, a stream of the single-server key layout; "
            f"on a cluster the queue's keys are {stream!r}, {keys.high_lane_stream(stream)!r} and "
            f"{keys.dead_letter_stream(stream)!r}: drain it with a worker on the old layout first, or "
            f"move its entries to {stream!r} (XRANGE + XADD) and delete it (docs/WORKER.md)"
        )
    if key_slot(dead.encode()) != key_slot(stream.encode()):
        raise InvalidURLError(
            f"dead_letter={dead!r} sits in another cluster slot than the stream {stream!r}; "
            f"give it the stream's hash tag, e.g. dead_letter={stream}:dead"
        )
    return stream, dead


def queue_lanes(url: str, parsed: ParsedURL, redis: Any, stream: str) -> QueueStreams:
    """The queue's streams with its `affinity_lanes` (default 1: no lanes). The first producer
    or worker records the count on the server; a URL that says another count is refused with
    an InvalidURLError, since jobs would then wait on lanes that nobody reads."""
    num_lanes = url_integer(parsed.params, "affinity_lanes")
    num_lanes = 1 if num_lanes is None else num_lanes
    try:
        streams = QueueStreams.of(stream, num_lanes, cluster=key_layout(url).hash_tags)
    except ValueError as exc:
        raise InvalidURLError(f"{exc} (in {redact_url(url)!r})") from None
    config = keys.lanes_config_key(stream)
    redis.set(config, num_lanes, nx=True)
    recorded = redis.get(config)
    if recorded is not None and int(recorded) != num_lanes:
        raise InvalidURLError(
            f"the queue {stream!r} has affinity_lanes={int(recorded)} (recorded in {config!r}); "
            f"{redact_url(url)!r} says {num_lanes}: give every producer and worker the same count, or, "
            f"to change it, stop the producers, drain the queue and delete {config!r}"
        )
    return streams
