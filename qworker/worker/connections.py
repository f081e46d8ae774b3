"""Queue and result-store URLs: parse them and open the matching source or sink.

    redis://host:port/db?stream=...&group=...&lease_timeout_s=...      job source
    redis://host:port/db?prefix=...&result_ttl_s=...&delta_ttl_s=...   result sink
    unix:///path/redis.socket?...                                       same, over a unix socket
    (none)                                                              the embedded Redis server

sqs://, celery+redis:// and s3:// register here too (issue 4), behind the same interfaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit

from qworker.errors import QworkerError
from qworker.worker import constants
from qworker.worker.sinks.base import ResultSink
from qworker.worker.sources.base import JobProducer, JobSource

REDIS_SCHEMES = ("redis", "rediss", "unix")


class InvalidURLError(QworkerError, ValueError):
    """A queue or result URL that qworker cannot use."""


@dataclass
class ParsedURL:
    scheme: str
    # The URL without qworker's own query parameters: what the client library connects to.
    connection_url: str
    params: dict[str, str]


def parse_url(url: str, known_params: set[str]) -> ParsedURL:
    parts = urlsplit(url)
    if not parts.scheme:
        raise InvalidURLError(f"URL {url!r} has no scheme; use redis://host:port/db?stream=...")
    query = parse_qsl(parts.query, keep_blank_values=True)
    params = {k: v for k, v in query if k in known_params}
    rest = [(k, v) for k, v in query if k not in known_params]
    # Rebuilt by hand: urlunsplit turns unix:///path into unix:/path.
    base = url.split("?", 1)[0]
    connection_url = f"{base}?{urlencode(rest)}" if rest else base
    return ParsedURL(parts.scheme, connection_url, params)


def resolve_url(url: str | None) -> str:
    """`url`, or the embedded Redis server's URL when none is given."""
    if url:
        return url
    from qworker.worker.embedded import embedded_redis_url

    return embedded_redis_url()


def _number(params: dict[str, str], name: str, default: float) -> float:
    if name not in params:
        return default
    try:
        return float(params[name])
    except ValueError:
        raise InvalidURLError(f"URL parameter {name}={params[name]!r} is not a number") from None


def redis_client(connection_url: str):  # -> redis.Redis
    import redis

    return redis.Redis.from_url(connection_url, health_check_interval=30)


SOURCE_PARAMS = {"stream", "group", "dead_letter", "lease_timeout_s"}
SINK_PARAMS = {"prefix", "result_ttl_s", "delta_ttl_s", "delta_maxlen"}


def open_source(url: str | None, consumer: str, lease_timeout_s: float | None = None) -> JobSource:
    url = resolve_url(url)
    parsed = parse_url(url, SOURCE_PARAMS | SINK_PARAMS)
    if parsed.scheme in REDIS_SCHEMES:
        from qworker.worker.sources.redis_streams import RedisStreamSource

        stream = parsed.params.get("stream", constants.DEFAULT_STREAM)
        return RedisStreamSource(
            redis_client(parsed.connection_url),
            stream=stream,
            group=parsed.params.get("group", constants.DEFAULT_GROUP),
            consumer=consumer,
            dead_letter_stream=parsed.params.get("dead_letter", constants.dead_letter_stream(stream)),
            lease_timeout_s=lease_timeout_s or _number(parsed.params, "lease_timeout_s", 30.0),
        )
    raise InvalidURLError(
        f"unsupported queue URL scheme {parsed.scheme!r} in {url!r}; use redis:// or unix://"
    )


def open_producer(url: str | None) -> JobProducer:
    url = resolve_url(url)
    parsed = parse_url(url, SOURCE_PARAMS | SINK_PARAMS)
    if parsed.scheme in REDIS_SCHEMES:
        from qworker.worker.sources.redis_streams import RedisStreamProducer

        return RedisStreamProducer(
            redis_client(parsed.connection_url),
            stream=parsed.params.get("stream", constants.DEFAULT_STREAM),
            group=parsed.params.get("group", constants.DEFAULT_GROUP),
        )
    raise InvalidURLError(
        f"unsupported queue URL scheme {parsed.scheme!r} in {url!r}; use redis:// or unix://"
    )


def open_sink(url: str | None) -> ResultSink:
    url = resolve_url(url)
    parsed = parse_url(url, SOURCE_PARAMS | SINK_PARAMS)
    if parsed.scheme in REDIS_SCHEMES:
        from qworker.worker.sinks.redis import RedisResultSink

        return RedisResultSink(
            redis_client(parsed.connection_url),
            prefix=parsed.params.get("prefix", constants.DEFAULT_RESULT_PREFIX),
            result_ttl_s=int(_number(parsed.params, "result_ttl_s", constants.DEFAULT_RESULT_TTL_S)),
            delta_ttl_s=int(_number(parsed.params, "delta_ttl_s", constants.DEFAULT_DELTA_TTL_S)),
            delta_maxlen=int(_number(parsed.params, "delta_maxlen", constants.DEFAULT_DELTA_MAXLEN)),
        )
    raise InvalidURLError(
        f"unsupported results URL scheme {parsed.scheme!r} in {url!r}; use redis:// or unix://"
    )
