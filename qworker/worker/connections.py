"""Queue and result-store URLs: parse them and open the matching source, producer or sink.

    redis://host:port/db?stream=...&group=...&lease_timeout_s=...      job source
    redis://host:port/db?prefix=...&result_ttl_s=...&delta_ttl_s=...   result sink
    rediss://..., unix:///path/redis.socket?...                         same, over TLS or a unix socket
    (none)                                                              the embedded Redis server

    sqs://QUEUE?region=...&endpoint_url=...&dead_letter=...&lease_timeout_s=...&payload_s3=s3://b/p
                                                                        job source (AWS SQS)
    s3://bucket/prefix?region=...&endpoint_url=...&conditional_put=true   result sink (AWS S3)
    celery+redis://host:port/db?queue=qworker&lease_timeout_s=...        job source (Celery messages)
                                                                        and, as results, Celery's
                                                                        Redis result backend
    memory://NAME                                                       both, in this process only

Which module opens which scheme is a table (QUEUE_BACKENDS, RESULT_BACKENDS), as in kombu's
TRANSPORT_ALIASES: a queue backend module has `open_source(url, consumer, lease_timeout_s)` and
`open_producer(url, payload_location)`, a results backend module has `open_sink(url)`. Adding a
backend is one module and one line here; error messages and help text read the table.

Final results and the live token stream may go to different stores: open_sink(results,
stream_results) (see sinks/split.py). AWS credentials come from boto3's standard chain.

Credentials and TLS: redis://user:password@host:port/db (or redis://:password@...) authenticates;
rediss://... connects over TLS, with redis-py's ssl_* query parameters passed through, e.g.
rediss://:pw@host:6380/0?ssl_ca_certs=/etc/ssl/ca.pem or ?ssl_cert_reqs=none. A query parameter
that neither qworker nor the client library takes is an InvalidURLError that lists the accepted
ones. Whatever is logged or shown goes through redact_url first.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from qworker.errors import QworkerError
from qworker.worker.sinks.base import ResultSink
from qworker.worker.sources.base import JobProducer, JobSource

T = TypeVar("T")

# URL scheme -> the module that opens it, imported on first use.
QUEUE_BACKENDS: dict[str, str] = {
    "redis": "qworker.worker.sources.redis_streams",
    "rediss": "qworker.worker.sources.redis_streams",
    "unix": "qworker.worker.sources.redis_streams",
    "sqs": "qworker.worker.sources.sqs",
    "celery+redis": "qworker.worker.sources.celery",
    "celery+rediss": "qworker.worker.sources.celery",
    "memory": "qworker.worker.sources.memory",
}
RESULT_BACKENDS: dict[str, str] = {
    "redis": "qworker.worker.sinks.redis",
    "rediss": "qworker.worker.sinks.redis",
    "unix": "qworker.worker.sinks.redis",
    "s3": "qworker.worker.sinks.s3",
    "celery+redis": "qworker.worker.sinks.celery",
    "celery+rediss": "qworker.worker.sinks.celery",
    "memory": "qworker.worker.sinks.memory",
}

# qworker's own query parameters, per backend. A Redis URL may serve as queue and results at
# once, so both sets are accepted on either side.
SOURCE_PARAMS = {"stream", "group", "dead_letter", "lease_timeout_s", "high_lane_max_priority"}
SINK_PARAMS = {"prefix", "result_ttl_s", "delta_ttl_s", "delta_maxlen"}
AWS_PARAMS = {
    "region",
    "endpoint_url",
    "dead_letter",
    "lease_timeout_s",
    "payload_s3",
    "conditional_put",
    "retry_mode",
    "max_attempts",
}
# botocore's retry modes: "standard" retries throttling (ThrottlingException, SlowDown, ...),
# 5xx and connection errors with exponential backoff and jitter (at most 20 s between attempts)
# under a client-side retry quota; "adaptive" adds a client-side rate limiter that slows down
# while the service throttles. max_attempts counts the first call: 8 calls span at most about
# a minute of backoff before the error reaches the worker.
AWS_RETRY_MODES = ("standard", "adaptive")
AWS_DEFAULT_RETRY_MODE = "standard"
AWS_DEFAULT_MAX_ATTEMPTS = 8
# Above this, a call could retry for many minutes while the worker holds leases it cannot extend.
AWS_MAX_MAX_ATTEMPTS = 20
CELERY_PARAMS = {"queue", "dead_letter", "lease_timeout_s", "result_ttl_s", "prefix"}

# redis-py connection arguments that make sense as URL text. from_url passes any query value it
# does not know as a string, so a flag such as decode_responses=false would arrive as the true
# string "false"; only the arguments it parses itself (URL_QUERY_ARGUMENT_PARSERS) and these
# text ones are accepted.
_REDIS_TEXT_PARAMS = {
    "client_name",
    "username",
    "password",
    "encoding",
    "encoding_errors",
    "lib_name",
    "lib_version",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ca_data",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_ciphers",
    "ssl_password",
}
# What kombu takes from a broker URL's query without a TypeError: its ssl_* options.
KOMBU_PARAMS = {"ssl_*"}


class InvalidURLError(QworkerError, ValueError):
    """A queue or result URL that qworker cannot use."""


@dataclass
class ParsedURL:
    scheme: str
    # The URL without qworker's own query parameters: what the client library connects to.
    connection_url: str
    params: dict[str, str]


# -- the backend table -----------------------------------------------------------------------


def queue_schemes() -> tuple[str, ...]:
    """URL schemes a job queue can use, e.g. for help text."""
    return tuple(QUEUE_BACKENDS)


def result_schemes() -> tuple[str, ...]:
    """URL schemes a result store can use."""
    return tuple(RESULT_BACKENDS)


def schemes_text(schemes: Iterable[str]) -> str:
    """'redis://, sqs:// or memory://'."""
    names = [f"{scheme}://" for scheme in schemes]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def _backend(table: dict[str, str], role: str, url: str) -> ModuleType:
    scheme = urlsplit(url).scheme
    if not scheme:
        raise InvalidURLError(f"{role} URL {redact_url(url)!r} has no scheme; use {schemes_text(table)}")
    module_path = table.get(scheme)
    if module_path is None:
        raise InvalidURLError(
            f"unsupported {role} URL scheme {scheme!r} in {redact_url(url)!r}; use {schemes_text(table)}"
        )
    return importlib.import_module(module_path)


def open_source(url: str | None, consumer: str, lease_timeout_s: float | None = None) -> JobSource:
    """The job source at `url` (none: the embedded Redis), read as `consumer`. `lease_timeout_s`
    overrides the URL's."""
    url = resolve_url(url)
    source: JobSource = _backend(QUEUE_BACKENDS, "queue", url).open_source(url, consumer, lease_timeout_s)
    return source


def open_producer(url: str | None, payload_location: str | None = None) -> JobProducer:
    """The sending side of a queue URL. `payload_location` (s3://bucket/prefix) is where an SQS
    producer puts jobs too large for a message, unless the URL's `payload_s3` says otherwise."""
    url = resolve_url(url)
    producer: JobProducer = _backend(QUEUE_BACKENDS, "queue", url).open_producer(url, payload_location)
    return producer


def open_sink(url: str | None, stream_url: str | None = None) -> ResultSink:
    """The result store at `url`; with `stream_url`, live deltas and cancel flags go there instead
    ("stream to X, final to Y")."""
    if stream_url:
        from qworker.worker.sinks.split import SplitSink

        return SplitSink(final=open_sink(url), stream=open_sink(stream_url))
    url = resolve_url(url)
    sink: ResultSink = _backend(RESULT_BACKENDS, "results", url).open_sink(url)
    return sink


def default_results_url(queue_url: str) -> str:
    """The results store when none is given: the queue's own server, when it can store results."""
    scheme = urlsplit(queue_url).scheme
    if scheme not in RESULT_BACKENDS:
        raise InvalidURLError(
            f"a {scheme}:// queue needs a results URL ({schemes_text(RESULT_BACKENDS)}); pass --results"
        )
    return queue_url


def resolve_url(url: str | None) -> str:
    """`url`, or the embedded Redis server's URL when none is given."""
    if url:
        return url
    from qworker.worker.embedded import embedded_redis_url

    return embedded_redis_url()


# -- parsing ---------------------------------------------------------------------------------

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
    """Split qworker's own query parameters (`known_params`) from the rest."""
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


def _is_accepted(name: str, accepted: set[str]) -> bool:
    return name in accepted or any(p.endswith("*") and name.startswith(p[:-1]) for p in accepted)


def reject_unknown_params(
    url: str, names: Iterable[str], own: set[str], library: tuple[str, set[str]] | None = None
) -> None:
    """Raise InvalidURLError naming each query parameter in `names` that is neither one of
    qworker's (`own`) nor one the client library takes (`library`: its name and parameters;
    a name ending in * is a prefix)."""
    library_params = library[1] if library is not None else set()
    unknown = [n for n in dict.fromkeys(names) if n not in own and not _is_accepted(n, library_params)]
    if not unknown:
        return
    accepted = f"qworker's: {', '.join(sorted(own)) or '(none)'}"
    if library is not None:
        accepted += f"; {library[0]}'s: {', '.join(sorted(library_params))}"
    raise InvalidURLError(
        f"unknown URL parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
        f"in {redact_url(url)!r}. Accepted ({accepted})"
    )


def _url_value(params: dict[str, str], name: str, parse: Callable[[str], T], what: str) -> T | None:
    """URL parameter `name` parsed by `parse`; None when absent."""
    if name not in params:
        return None
    try:
        return parse(params[name])
    except ValueError:
        raise InvalidURLError(f"URL parameter {name}={params[name]!r} is not {what}") from None


def url_number(params: dict[str, str], name: str, default: float) -> float:
    value = _url_value(params, name, float, "a number")
    return default if value is None else value


def url_integer(params: dict[str, str], name: str) -> int | None:
    """An optional integer URL parameter; None when absent."""
    return _url_value(params, name, int, "an integer")


def url_flag(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidURLError(f"URL parameter {name}={value!r} is not a boolean")


# -- Redis and Celery ------------------------------------------------------------------------


def _init_params(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names.update(
                p.name
                for p in inspect.signature(init).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
            )
    return names


def redis_url_params(scheme: str) -> set[str]:
    """The query parameters redis-py's from_url takes for `scheme` (redis, rediss or unix) and
    passes on without error, as far as they make sense as text."""
    import redis.connection as rc

    connection_class = {"rediss": rc.SSLConnection, "unix": rc.UnixDomainSocketConnection}.get(
        scheme, rc.Connection
    )
    takes = _init_params(connection_class) | _init_params(rc.ConnectionPool)
    return (set(rc.URL_QUERY_ARGUMENT_PARSERS) | _REDIS_TEXT_PARAMS) & takes


def parse_redis_url(url: str, own_params: set[str]) -> ParsedURL:
    """parse_url for a URL that redis-py connects to (redis://, rediss://, unix://, and the
    celery+ forms): any other query parameter must be one redis-py takes, else InvalidURLError
    (redis-py itself would raise a TypeError at the first command)."""
    parsed = parse_url(url, own_params)
    names = [k for k, _ in parse_qsl(urlsplit(parsed.connection_url).query, keep_blank_values=True)]
    scheme = parsed.scheme.removeprefix("celery+")
    reject_unknown_params(url, names, own_params, ("redis-py", redis_url_params(scheme)))
    return parsed


# Connections one client may open. redis-py 8 caps a pool at 100 by default, and a Client that
# streams many jobs at once holds one connection per live stream (a blocking XREAD), so the 101st
# concurrent stream failed with MaxConnectionsError. The server's own limit (maxclients, 10,000 by
# default) is the one that matters.
REDIS_MAX_CONNECTIONS = 10_000


def redis_client(connection_url: str) -> Any:  # a redis.Redis
    import redis

    return redis.Redis.from_url(
        connection_url, health_check_interval=30, max_connections=REDIS_MAX_CONNECTIONS
    )


def celery_broker_url(connection_url: str) -> str:
    """celery+redis://... -> redis://... (what kombu and redis-py connect to)."""
    return connection_url.removeprefix("celery+")


# -- AWS -------------------------------------------------------------------------------------


def aws_parts(url: str) -> tuple[str, str, dict[str, str]]:
    """(netloc, path, params) of an sqs:// or s3:// URL; unknown parameters are an error."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    reject_unknown_params(url, query, AWS_PARAMS)
    if not parts.netloc:
        raise InvalidURLError(f"URL {redact_url(url)!r} names no queue or bucket")
    return parts.netloc, parts.path, query


def aws_client(service: str, params: dict[str, str]) -> Any:  # a boto3 client
    """A boto3 client. Credentials come from boto3's standard chain (environment, profile, instance
    role); the region, endpoint and retry policy (retry_mode, max_attempts) come from the URL."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        service,
        region_name=params.get("region") or None,
        endpoint_url=params.get("endpoint_url") or None,
        config=Config(retries=aws_retries(params)),
    )


def aws_retries(params: dict[str, str]) -> dict[str, Any]:
    """botocore's `retries` config from the URL's retry_mode and max_attempts."""
    mode = params.get("retry_mode") or AWS_DEFAULT_RETRY_MODE
    if mode not in AWS_RETRY_MODES:
        raise InvalidURLError(f"URL parameter retry_mode={mode!r}: use {' or '.join(AWS_RETRY_MODES)}")
    attempts = url_number(params, "max_attempts", AWS_DEFAULT_MAX_ATTEMPTS)
    if attempts != int(attempts) or not 1 <= attempts <= AWS_MAX_MAX_ATTEMPTS:
        raise InvalidURLError(
            f"URL parameter max_attempts={params['max_attempts']!r}: "
            f"a whole number from 1 to {AWS_MAX_MAX_ATTEMPTS}"
        )
    return {"mode": mode, "total_max_attempts": int(attempts)}


def s3_location_of_results(url: str) -> str | None:
    """Where a client puts large job payloads by default: under the results prefix of an s3:// URL."""
    if not url.startswith("s3://"):
        return None
    bucket, path, _ = aws_parts(url)
    prefix = path.strip("/")
    return f"s3://{bucket}/{prefix + '/' if prefix else ''}_payloads"
