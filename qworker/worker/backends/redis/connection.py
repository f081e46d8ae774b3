"""Redis URLs and clients, for every backend that talks to Redis (Redis Streams and results here,
Celery's broker and result backend in ../celery/).

    redis://user:password@host:port/db?...   rediss://... (TLS)   unix:///path/redis.socket?...

A query parameter that neither qworker (`own_params`) nor redis-py takes is an InvalidURLError
that lists the accepted ones; rediss:// passes redis-py's ssl_* parameters through.
"""

from __future__ import annotations

import inspect
from typing import Any

from qworker.worker.urls import ParsedURL, parse_url, query_names, reject_unknown_params

# qworker's own query parameters. A Redis URL may serve as queue and results at once, so both
# sets are accepted on either side.
SOURCE_PARAMS = {"stream", "group", "dead_letter", "lease_timeout_s", "high_lane_max_priority"}
SINK_PARAMS = {"prefix", "result_ttl_s", "delta_ttl_s", "delta_maxlen"}
URL_PARAMS = SOURCE_PARAMS | SINK_PARAMS

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

# Connections one client may open. redis-py 8 caps a pool at 100 by default, and a Client that
# streams many jobs at once holds one connection per live stream (a blocking XREAD), so the 101st
# concurrent stream failed with MaxConnectionsError. The server's own limit (maxclients, 10,000 by
# default) is the one that matters.
REDIS_MAX_CONNECTIONS = 10_000


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


def parse_redis_url(url: str, own_params: set[str] = URL_PARAMS) -> ParsedURL:
    """parse_url for a URL that redis-py connects to (redis://, rediss://, unix://, and the
    celery+ forms): any other query parameter must be one redis-py takes, else InvalidURLError
    (redis-py itself would raise a TypeError at the first command)."""
    parsed = parse_url(url, own_params)
    scheme = parsed.scheme.removeprefix("celery+")
    names = query_names(parsed.connection_url)
    reject_unknown_params(url, names, own_params, ("redis-py", redis_url_params(scheme)))
    return parsed


def redis_client(connection_url: str) -> Any:  # a redis.Redis
    import redis

    return redis.Redis.from_url(
        connection_url, health_check_interval=30, max_connections=REDIS_MAX_CONNECTIONS
    )
