"""Redis URLs and clients, for every backend that talks to Redis (Redis Streams and results here,
Celery's broker and result backend in ../celery/).

    redis://user:password@host:port/db?...   rediss://... (TLS)   unix:///path/redis.socket?...
    redis+cluster://host:port,host:port/?...  rediss+cluster://... (a Redis Cluster: cluster.py)
    redis+sentinel://s1:26379,s2:26379/SERVICE/db?...  (the primary Sentinel names: sentinel.py)

A query parameter that neither qworker (`own_params`) nor redis-py takes is an InvalidURLError
that lists the accepted ones; rediss:// passes redis-py's ssl_* parameters through.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

from qworker.backends.redis import keys
from qworker.backends.redis.cluster import CLUSTER_SCHEME, CLUSTER_TLS_SCHEME, cluster_client
from qworker.backends.redis.sentinel import SENTINEL_SCHEME, sentinel_client
from qworker.backends.urls import (
    ParsedURL,
    parse_url,
    query_names,
    reject_unknown_params,
    url_integer,
    url_scheme,
)

logger = logging.getLogger(__name__)

# qworker's own query parameters. A Redis URL may serve as queue and results at once, so both
# sets are accepted on either side.
SOURCE_PARAMS = {
    "stream",
    "group",
    "dead_letter",
    "lease_timeout_s",
    "high_lane_max_priority",
    "affinity_lanes",
    "steal_after_s",
}
SINK_PARAMS = {"prefix", "result_ttl_s", "delta_ttl_s", "delta_maxlen"}
# WAIT after writes that must survive a failover: how many replicas, how long (wait_for_replicas).
DURABILITY_PARAMS = {"wait_replicas", "wait_timeout_ms"}
SOURCE_PARAMS |= DURABILITY_PARAMS
SINK_PARAMS |= DURABILITY_PARAMS
URL_PARAMS = SOURCE_PARAMS | SINK_PARAMS
# Replicas a write waits for when the URL does not say: one under Sentinel (a failover promotes
# a replica, which must hold the write), none elsewhere.
DEFAULT_WAIT_REPLICAS = {SENTINEL_SCHEME: 1}
DEFAULT_WAIT_TIMEOUT_MS = 1000
# A write that fewer replicas acknowledged is logged at most this often.
_SHORT_WAIT_LOG_INTERVAL_S = 10.0

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
# A worker's Redis call that hangs (a partitioned network, not a refused connection) fails after
# this long, so that the worker's outage clock keeps running. Longer than any blocking read the
# worker makes.
SOCKET_TIMEOUT_S = 10.0
SOCKET_CONNECT_TIMEOUT_S = 5.0


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

    connection_class = {
        "rediss": rc.SSLConnection,
        CLUSTER_TLS_SCHEME: rc.SSLConnection,
        "unix": rc.UnixDomainSocketConnection,
    }.get(scheme, rc.Connection)
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


def redis_client(connection_url: str) -> Any:  # a redis.Redis, or a RedisCluster
    """The client of a URL without qworker's parameters. A cluster or Sentinel client gets the
    worker's finite socket timeouts unless the URL sets its own (a plain one gets them from
    bound_socket_timeouts where the worker needs them)."""
    import redis

    scheme = url_scheme(connection_url)
    topology = {
        CLUSTER_SCHEME: cluster_client,
        CLUSTER_TLS_SCHEME: cluster_client,
        SENTINEL_SCHEME: sentinel_client,
    }
    if scheme in topology:
        return topology[scheme](
            connection_url,
            max_connections=REDIS_MAX_CONNECTIONS,
            socket_timeout_s=SOCKET_TIMEOUT_S,
            connect_timeout_s=SOCKET_CONNECT_TIMEOUT_S,
        )
    return redis.Redis.from_url(
        connection_url, health_check_interval=30, max_connections=REDIS_MAX_CONNECTIONS
    )


def worker_client(connection_url: str) -> Any:
    """redis_client with finite socket timeouts on every kind of client (the worker's side)."""
    client = redis_client(connection_url)
    is_cluster = url_scheme(connection_url) in (CLUSTER_SCHEME, CLUSTER_TLS_SCHEME)
    return client if is_cluster else bound_socket_timeouts(client)


def bound_socket_timeouts(client: Any) -> Any:
    """Give a redis.Redis client finite socket timeouts (new connections use them)."""
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("socket_timeout") is None:
        kwargs["socket_timeout"] = SOCKET_TIMEOUT_S
    if kwargs.get("socket_connect_timeout") is None:
        kwargs["socket_connect_timeout"] = SOCKET_CONNECT_TIMEOUT_S
    return client


def key_layout(url: str) -> keys.KeyLayout:
    """Hash-tagged keys on a cluster, the single-server names anywhere else."""
    return keys.CLUSTER if url_scheme(url) in (CLUSTER_SCHEME, CLUSTER_TLS_SCHEME) else keys.SINGLE_SERVER


@dataclass(frozen=True)
class Durability:
    """WAIT after writes that must survive a failover: `replicas` replicas (0: no WAIT)."""

    replicas: int
    timeout_ms: int

    def wait(self, redis: Any) -> None:
        if self.replicas <= 0:
            return
        acked = int(redis.wait(self.replicas, self.timeout_ms))
        if acked < self.replicas:
            _log_short_wait(acked, self.replicas, self.timeout_ms)


_last_short_wait_log = 0.0


def _log_short_wait(acked: int, replicas: int, timeout_ms: int) -> None:
    global _last_short_wait_log
    now = time.monotonic()
    if now - _last_short_wait_log >= _SHORT_WAIT_LOG_INTERVAL_S:
        _last_short_wait_log = now
        logger.warning(
            "a write reached %d of %d replicas within %d ms; a failover now could lose it",
            acked,
            replicas,
            timeout_ms,
        )


# No WAIT: a single server, or a caller that opens its client by hand.
NO_WAIT = Durability(replicas=0, timeout_ms=0)


def durability(parsed: ParsedURL) -> Durability:
    """The URL's wait_replicas and wait_timeout_ms, with the scheme's defaults."""
    replicas = url_integer(parsed.params, "wait_replicas")
    timeout_ms = url_integer(parsed.params, "wait_timeout_ms")
    return Durability(
        replicas=replicas if replicas is not None else DEFAULT_WAIT_REPLICAS.get(parsed.scheme, 0),
        timeout_ms=timeout_ms if timeout_ms is not None else DEFAULT_WAIT_TIMEOUT_MS,
    )
