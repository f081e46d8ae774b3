"""celery+redis:// and celery+rediss:// URLs: qworker's parameters, and the broker URL that kombu
and redis-py connect to.

    celery+redis://host:port/db?queue=qworker&lease_timeout_s=...&dead_letter=...&prefix=...
"""

from __future__ import annotations

from qworker.backends.redis.connection import parse_redis_url
from qworker.backends.urls import parse_url, query_names, reject_unknown_params

CELERY_PARAMS = {"queue", "dead_letter", "lease_timeout_s", "result_ttl_s", "prefix"}
# What kombu takes from a broker URL's query without a TypeError: its ssl_* options.
KOMBU_PARAMS = {"ssl_*"}


def celery_broker_url(connection_url: str) -> str:
    """celery+redis://... -> redis://... (what kombu and redis-py connect to)."""
    return connection_url.removeprefix("celery+")


def parse_celery_url(url: str) -> tuple[str, dict[str, str]]:
    """(broker URL, qworker's parameters) of a URL that kombu reads (the source and producer):
    other parameters must be kombu's."""
    parsed = parse_url(url, CELERY_PARAMS)
    reject_unknown_params(url, query_names(parsed.connection_url), CELERY_PARAMS, ("kombu", KOMBU_PARAMS))
    return celery_broker_url(parsed.connection_url), parsed.params


def parse_celery_redis_url(url: str) -> tuple[str, dict[str, str]]:
    """(Redis URL, qworker's parameters) of a URL that redis-py reads (the result backend)."""
    parsed = parse_redis_url(url, CELERY_PARAMS)
    return celery_broker_url(parsed.connection_url), parsed.params
