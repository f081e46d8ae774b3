"""Redis with Sentinel failover: `redis+sentinel://[user:password@]s1:26379[,s2:26379...]/SERVICE[/db]?...`.

The sentinels are asked for the primary of SERVICE on every new connection (redis-py's
SentinelConnectionPool). When the primary dies and a replica is promoted, the worker's broker
calls fail for a moment, qworker's retry logic (retry.py) backs off and retries, and the next
connection goes to the new primary; a connection to the old primary after it came back as a
replica gets READONLY, which redis-py turns into a reconnect. The user and password in the URL
are the primary's; the sentinels are reached without them.

Writes that must survive a failover (a job sent, a result stored, a dead letter) are followed by
`WAIT <wait_replicas> <wait_timeout_ms>` (connection.wait_for_replicas; 1 replica by default in
this mode). Replication stays asynchronous: see docs/WORKER.md for what can still be lost.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from qworker.backends.redis.cluster import node_urls
from qworker.backends.urls import InvalidURLError, redact_url

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


def sentinel_client(
    connection_url: str, *, max_connections: int, socket_timeout_s: float, connect_timeout_s: float
) -> Any:
    """A redis.Redis on the current primary of the URL's service, or an InvalidURLError of one
    line when the sentinels that answer know no such service."""
    import redis
    from redis.connection import parse_url
    from redis.sentinel import Sentinel

    nodes, first = node_urls(connection_url, "redis", DEFAULT_SENTINEL_PORT)
    path = [unquote(p) for p in urlsplit(first).path.split("/") if p]
    if not path or len(path) > 2:
        raise InvalidURLError(
            f"{redact_url(connection_url)!r} names no service; use "
            f"{SENTINEL_SCHEME}://sentinel:26379,sentinel2:26379/SERVICE/db"
        )
    service = path[0]
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise InvalidURLError(f"bad database number {path[1]!r} in {redact_url(connection_url)!r}") from None
    # The primary's connection arguments: the URL's user, password and query, without the path.
    parts = urlsplit(first)
    kwargs = parse_url(f"redis://{parts.netloc}/0" + (f"?{parts.query}" if parts.query else ""))
    for name in ("host", "port", "db", "connection_class"):
        kwargs.pop(name, None)
    kwargs.setdefault("socket_timeout", socket_timeout_s)
    kwargs.setdefault("socket_connect_timeout", connect_timeout_s)
    sentinel = Sentinel(
        nodes,
        sentinel_kwargs={"socket_timeout": socket_timeout_s, "socket_connect_timeout": connect_timeout_s},
    )
    _check_service(sentinel, service, connection_url)
    return sentinel.master_for(
        service,
        redis_class=redis.Redis,
        db=db,
        max_connections=max_connections,
        health_check_interval=30,
        **kwargs,
    )


def _check_service(sentinel: Any, service: str, connection_url: str) -> None:
    """InvalidURLError when a sentinel answers and none that answer monitors `service`. With no
    sentinel answering, nothing is decided here: the first command fails as an outage would."""
    import redis

    known: set[str] = set()
    answered = False
    for node in sentinel.sentinels:
        try:
            masters = node.sentinel_masters()
        except (redis.ConnectionError, redis.TimeoutError):
            continue
        answered = True
        known.update(str(name) for name in masters)
        if service in known:
            return
    if answered:
        raise InvalidURLError(
            f"the sentinels at {redact_url(connection_url)!r} monitor no service {service!r} "
            f"(they know: {', '.join(sorted(known)) or 'none'}); fix the service name in the URL path"
        )
