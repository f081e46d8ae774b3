"""Redis Cluster clients: `redis+cluster://[user:password@]host:port[,host:port...][/0]?...`.

Any listed node is a startup node; redis-py's RedisCluster learns the rest of the cluster from
it, follows MOVED and ASK replies (a slot being resharded) and reloads the slot map after a
node fails. Keys carry hash tags on a cluster (keys.KeyLayout): a queue sits in one slot and
jobs spread over the cluster. Celery has no cluster transport, so `celery+redis+cluster://` does
not exist.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from qworker.backends.urls import InvalidURLError, redact_url

CLUSTER_SCHEME = "redis+cluster"
CLUSTER_TLS_SCHEME = "rediss+cluster"
DEFAULT_PORT = 6379


def split_hosts(netloc_hosts: str, default_port: int) -> list[tuple[str, int]]:
    """[(host, port)] of 'h1:p1,h2,h3:p3' (a missing port is `default_port`)."""
    nodes = []
    for item in netloc_hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep:
            host, port = port, ""
        if not host:
            raise ValueError(f"no host in {item!r}")
        nodes.append((host, int(port) if port else default_port))
    return nodes


def node_urls(url: str, plain_scheme: str, default_port: int) -> tuple[list[tuple[str, int]], str]:
    """(nodes, single-node URL) of a multi-host URL: the single-node URL is the first node's, in
    `plain_scheme`, with the same user, password, path and query, for redis-py's parse_url."""
    scheme, _, rest = url.partition("://")
    end = min([i for i in (rest.find(c) for c in "/?#") if i != -1], default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    try:
        nodes = split_hosts(hosts, default_port)
    except ValueError as exc:
        raise InvalidURLError(
            f"bad host list in {redact_url(url)!r}: {exc}; use {scheme}://host:port,host:port/..."
        ) from None
    host, port = nodes[0]
    return nodes, f"{plain_scheme}://{userinfo}{at}{host}:{port}{tail}"


def cluster_client(
    connection_url: str, *, max_connections: int, socket_timeout_s: float, connect_timeout_s: float
) -> Any:
    """A redis.cluster.RedisCluster for a redis+cluster:// URL (qworker's own parameters
    already removed), or an InvalidURLError of one line when the server is no cluster."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster
    from redis.connection import parse_url
    from redis.exceptions import RedisClusterException

    tls = urlsplit(connection_url).scheme == CLUSTER_TLS_SCHEME
    nodes, first = node_urls(connection_url, "rediss" if tls else "redis", DEFAULT_PORT)
    kwargs = parse_url(first)
    for name in ("host", "port", "connection_class"):
        kwargs.pop(name, None)
    if int(kwargs.pop("db", 0) or 0) != 0:
        raise InvalidURLError(f"a Redis Cluster has only database 0: {redact_url(connection_url)!r}")
    kwargs.setdefault("socket_timeout", socket_timeout_s)
    kwargs.setdefault("socket_connect_timeout", connect_timeout_s)
    if tls:
        kwargs["ssl"] = True
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            max_connections=max_connections,
            health_check_interval=30,
            **kwargs,
        )
    except RedisClusterException as exc:
        if "not enabled" in str(exc):
            raise InvalidURLError(
                f"{redact_url(connection_url)!r} points at a Redis server that is not a cluster "
                "(cluster_enabled:0); use redis://host:port/db for a single server"
            ) from None
        raise redis.ConnectionError(f"Redis Cluster at {redact_url(connection_url)!r}: {exc}") from exc


def is_cluster_client(client: Any) -> bool:
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)
