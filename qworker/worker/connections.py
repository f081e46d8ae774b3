"""Queue and result-store URLs: parse them and open the matching source or sink.

    redis://host:port/db?stream=...&group=...&lease_timeout_s=...      job source
    redis://host:port/db?prefix=...&result_ttl_s=...&delta_ttl_s=...   result sink
    unix:///path/redis.socket?...                                       same, over a unix socket
    (none)                                                              the embedded Redis server

    sqs://QUEUE?region=...&endpoint_url=...&dead_letter=...&lease_timeout_s=...&payload_s3=s3://b/p
                                                                        job source (AWS SQS)
    s3://bucket/prefix?region=...&endpoint_url=...&conditional_put=true   result sink (AWS S3)
    celery+redis://host:port/db?queue=qworker&lease_timeout_s=...        job source (Celery messages)
                                                                        and, as results, Celery's
                                                                        Redis result backend

Final results and the live token stream may go to different stores: open_sink(results,
stream_results) (see sinks/split.py). AWS credentials come from boto3's standard chain.

Credentials and TLS: redis://user:password@host:port/db (or redis://:password@...) authenticates;
rediss://... connects over TLS, with redis-py's ssl_* query parameters passed through, e.g.
rediss://:pw@host:6380/0?ssl_ca_certs=/etc/ssl/ca.pem or ?ssl_cert_reqs=none. Whatever is logged or
shown goes through redact_url first.
"""

from __future__ import annotations

import re
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


_SECRET_QUERY = re.compile(r"([?&][^=&#]*(?:password|passwd|secret|token)[^=&#]*=)[^&#]*", re.IGNORECASE)


def redact_url(url: str | None) -> str:
    """`url` fit to log or show: the password in user:password@ and any password=/secret=/token=
    query value replaced by ***."""
    if not url:
        return "(embedded Redis)"
    scheme, sep, rest = url.partition("://")
    if sep:
        end = min([i for i in (rest.find(c) for c in "/?#") if i != -1], default=len(rest))
        netloc, tail = rest[:end], rest[end:]
        userinfo, at, host = netloc.rpartition("@")
        if at and ":" in userinfo:
            url = f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}{tail}"
    return _SECRET_QUERY.sub(r"\1***", url)


def parse_url(url: str, known_params: set[str]) -> ParsedURL:
    parts = urlsplit(url)
    if not parts.scheme:
        raise InvalidURLError(f"URL {redact_url(url)!r} has no scheme; use redis://host:port/db?stream=...")
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
AWS_PARAMS = {"region", "endpoint_url", "dead_letter", "lease_timeout_s", "payload_s3", "conditional_put"}
CELERY_PARAMS = {"queue", "dead_letter", "lease_timeout_s", "result_ttl_s", "prefix"}
CELERY_SCHEME = "celery+redis"
CELERY_TLS_SCHEME = "celery+rediss"


def _aws_parts(url: str) -> tuple[str, str, dict[str, str]]:
    """(netloc, path, params) of an sqs:// or s3:// URL; unknown parameters are an error."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(query) - AWS_PARAMS
    if unknown:
        raise InvalidURLError(
            f"unknown parameters {sorted(unknown)} in {redact_url(url)!r}; known: {sorted(AWS_PARAMS)}"
        )
    if not parts.netloc:
        raise InvalidURLError(f"URL {redact_url(url)!r} names no queue or bucket")
    return parts.netloc, parts.path, query


def aws_client(service: str, params: dict[str, str]):  # -> a boto3 client
    """A boto3 client. Credentials come from boto3's standard chain (environment, profile, instance
    role); only the region and endpoint come from the URL."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        service,
        region_name=params.get("region") or None,
        endpoint_url=params.get("endpoint_url") or None,
        config=Config(retries={"max_attempts": 5, "mode": "standard"}),
    )


def _is_true(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidURLError(f"URL parameter {name}={value!r} is not a boolean")


def s3_location_of_results(url: str) -> str | None:
    """Where a client puts large job payloads by default: under the results prefix of an s3:// URL."""
    if not url.startswith("s3://"):
        return None
    bucket, path, _ = _aws_parts(url)
    prefix = path.strip("/")
    return f"s3://{bucket}/{prefix + '/' if prefix else ''}_payloads"


def default_results_url(queue_url: str) -> str:
    """The results store when none is given: the queue's own server."""
    scheme = urlsplit(queue_url).scheme
    if scheme == "sqs":
        raise InvalidURLError(
            "an sqs:// queue needs a results URL (s3://bucket/prefix or redis://...); pass --results"
        )
    return queue_url


def open_source(url: str | None, consumer: str, lease_timeout_s: float | None = None) -> JobSource:
    url = resolve_url(url)
    scheme = urlsplit(url).scheme
    if scheme == "sqs":
        from qworker.worker.sources.sqs import SqsSource

        queue, _, params = _aws_parts(url)
        return SqsSource(
            aws_client("sqs", params),
            queue=queue,
            s3=aws_client("s3", params),
            dead_letter_queue=params.get("dead_letter"),
            lease_timeout_s=lease_timeout_s or (_number(params, "lease_timeout_s", 0) or None),
        )
    if scheme in (CELERY_SCHEME, CELERY_TLS_SCHEME):
        from qworker.worker.sources.celery import open_celery_source

        parsed = parse_url(url, CELERY_PARAMS)
        return open_celery_source(
            _celery_broker_url(parsed.connection_url),
            parsed.params,
            consumer=consumer,
            lease_timeout_s=lease_timeout_s or _number(parsed.params, "lease_timeout_s", 30.0),
        )
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
        f"unsupported queue URL scheme {parsed.scheme!r} in {redact_url(url)!r}; "
        "use redis://, unix://, sqs:// or celery+redis://"
    )


def _celery_broker_url(connection_url: str) -> str:
    """celery+redis://... -> redis://... (what kombu and redis-py connect to)."""
    return connection_url.removeprefix("celery+")


def open_producer(url: str | None, payload_location: str | None = None) -> JobProducer:
    """The sending side of a queue URL. `payload_location` (s3://bucket/prefix) is where an SQS
    producer puts jobs too large for a message, unless the URL's `payload_s3` says otherwise."""
    url = resolve_url(url)
    scheme = urlsplit(url).scheme
    if scheme == "sqs":
        from qworker.worker.sources.sqs import SqsProducer

        queue, _, params = _aws_parts(url)
        return SqsProducer(
            aws_client("sqs", params),
            queue=queue,
            s3=aws_client("s3", params),
            payload_location=params.get("payload_s3") or payload_location,
        )
    if scheme in (CELERY_SCHEME, CELERY_TLS_SCHEME):
        from qworker.worker.sources.celery import CeleryProducer

        parsed = parse_url(url, CELERY_PARAMS)
        return CeleryProducer(
            _celery_broker_url(parsed.connection_url), queue=parsed.params.get("queue", "qworker")
        )
    parsed = parse_url(url, SOURCE_PARAMS | SINK_PARAMS)
    if parsed.scheme in REDIS_SCHEMES:
        from qworker.worker.sources.redis_streams import RedisStreamProducer

        return RedisStreamProducer(
            redis_client(parsed.connection_url),
            stream=parsed.params.get("stream", constants.DEFAULT_STREAM),
            group=parsed.params.get("group", constants.DEFAULT_GROUP),
        )
    raise InvalidURLError(
        f"unsupported queue URL scheme {parsed.scheme!r} in {redact_url(url)!r}; "
        "use redis://, unix://, sqs:// or celery+redis://"
    )


def open_sink(url: str | None, stream_url: str | None = None) -> ResultSink:
    """The result store at `url`; with `stream_url`, live deltas and cancel flags go there instead
    ("stream to X, final to Y")."""
    if stream_url:
        from qworker.worker.sinks.split import SplitSink

        return SplitSink(final=open_sink(url), stream=open_sink(stream_url))
    url = resolve_url(url)
    scheme = urlsplit(url).scheme
    if scheme == "s3":
        from qworker.worker.sinks.s3 import S3ResultSink

        bucket, path, params = _aws_parts(url)
        return S3ResultSink(
            aws_client("s3", params),
            bucket=bucket,
            prefix=path,
            is_conditional_put=_is_true(params, "conditional_put", True),
        )
    if scheme in (CELERY_SCHEME, CELERY_TLS_SCHEME):
        from qworker.worker.sinks.celery import CeleryResultSink

        parsed = parse_url(url, CELERY_PARAMS)
        return CeleryResultSink(
            redis_client(_celery_broker_url(parsed.connection_url)),
            result_ttl_s=int(_number(parsed.params, "result_ttl_s", constants.DEFAULT_RESULT_TTL_S)),
            prefix=parsed.params.get("prefix", constants.DEFAULT_RESULT_PREFIX),
        )
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
        f"unsupported results URL scheme {parsed.scheme!r} in {redact_url(url)!r}; "
        "use redis://, unix://, s3:// or celery+redis://"
    )
