"""redis-py's failures as qworker reads them (../errors.py asks this module first for any redis
error; the Celery-on-Redis backend reads its redis errors here too).

Transient: ConnectionError (BusyLoadingError, a server still loading its AOF, is one),
TimeoutError, ReadOnlyError and the other replies in TRANSIENT_REPLY_PREFIXES; on a cluster,
ClusterError ("TTL exhausted": redis-py followed MOVED, ASK or TRYAGAIN replies as often as it
does while a slot moves or a node fails over) and SlotNotCoveredError.
Configuration: AuthenticationError (a ConnectionError subclass, yet no retry fixes a wrong
password) and NoPermissionError (an ACL without the command or key).
Any other reply (WRONGTYPE, NOGROUP, ...) is a bug or a data problem, not the server's state: None.
"""

from __future__ import annotations

from qworker.errors import BrokerConfigurationError, BrokerError, TransientBrokerError

LIBRARIES = ("redis",)

# Reply prefixes of a Redis that is up but cannot serve writes yet: a replica promoted by a
# failover that still reads-only, a primary whose replicas are down, a cluster slot moving.
TRANSIENT_REPLY_PREFIXES = ("READONLY", "MASTERDOWN", "LOADING", "TRYAGAIN", "CLUSTERDOWN")


def translate_error(exc: BaseException) -> BrokerError | None:
    import redis

    if isinstance(exc, redis.AuthenticationError):
        return BrokerConfigurationError(f"the server refused the credentials: {exc}")
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return BrokerConfigurationError(f"the server's ACL refuses this user the call: {exc}")
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | redis.ReadOnlyError):
        return TransientBrokerError(str(exc) or type(exc).__name__)
    if isinstance(exc, redis.exceptions.ClusterError | redis.exceptions.SlotNotCoveredError):
        return TransientBrokerError(str(exc) or type(exc).__name__)
    if isinstance(exc, redis.ResponseError) and str(exc).startswith(TRANSIENT_REPLY_PREFIXES):
        return TransientBrokerError(str(exc))
    return None
