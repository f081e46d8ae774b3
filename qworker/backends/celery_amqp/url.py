"""celery+amqp:// and celery+amqps:// URLs: the queue's settings, one source of truth for the
arguments it is declared with (they must be the ones the Celery producer's `task_queues` gives
it, or RabbitMQ answers PRECONDITION_FAILED to whichever side declares second).

    celery+amqp://user:pass@host:5672/vhost?queue=qworker
        &queue_type=classic|quorum      x-queue-type (default classic)
        &max_priority=N                 x-max-priority (classic only; absent: no priority)
        &delivery_limit=N               x-delivery-limit (quorum only; absent: unbounded)
        &declare=true|false             declare the queue (true) or only check it exists (false)
        &delivery_store=redis://h:p/db  where classic queues' deliveries are counted per task id
        &management_url=http://h:15672  the management API, for the unacked count (backlog.py)
        &ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...&ssl_cert_reqs=required|optional|none
                                        (amqps://; kombu's broker_use_ssl keys)

The queue's dead-letter exchange and queue are always `{queue}.dead` (direct, routing key the
queue name): the queue is declared with x-dead-letter-exchange set to it, so a quorum queue's
messages past x-delivery-limit land there too, with RabbitMQ's own x-death reason.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from qworker.backends.urls import (
    InvalidURLError,
    parse_url,
    redact_url,
    reject_unknown_params,
    url_flag,
    url_integer,
)

DEFAULT_QUEUE = "qworker"
DEFAULT_PORT = 5672
DEFAULT_TLS_PORT = 5671
SSL_PARAMS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"}
AMQP_PARAMS = {
    "queue",
    "queue_type",
    "max_priority",
    "delivery_limit",
    "declare",
    "delivery_store",
    "management_url",
    "lease_timeout_s",
    *SSL_PARAMS,
}
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def dead_letter_name(queue: str) -> str:
    """The dead-letter exchange and queue of `queue` (one name for both)."""
    return f"{queue}.dead"


@dataclass(frozen=True)
class AmqpQueue:
    """A Celery queue on RabbitMQ, as the URL describes it."""

    host: str
    port: int
    userid: str
    password: str
    virtual_host: str
    queue: str
    queue_type: Literal["classic", "quorum"]
    max_priority: int | None
    delivery_limit: int | None
    is_declared: bool
    delivery_store: str | None
    management_url: str | None
    # py-amqp's `ssl`: None for amqp://, else the broker_use_ssl-style dict (or True: defaults).
    tls: dict[str, Any] | bool | None

    @property
    def dead_letter(self) -> str:
        return dead_letter_name(self.queue)

    def queue_arguments(self) -> dict[str, Any]:
        """x-arguments of the job queue: exactly what the Celery `task_queues` in docs/WORKER.md give."""
        arguments: dict[str, Any] = {
            "x-queue-type": self.queue_type,
            "x-dead-letter-exchange": self.dead_letter,
            "x-dead-letter-routing-key": self.dead_letter,
        }
        if self.max_priority is not None:
            arguments["x-max-priority"] = self.max_priority
        if self.delivery_limit is not None:
            arguments["x-delivery-limit"] = self.delivery_limit
        return arguments

    def connect_kwargs(self) -> dict[str, Any]:
        """py-amqp's Connection arguments."""
        return {
            "host": f"{self.host}:{self.port}",
            "userid": self.userid,
            "password": self.password,
            "virtual_host": self.virtual_host,
            "ssl": self.tls or False,
            "connect_timeout": 5,
            # No heartbeats: the worker calls the broker every engine step anyway, and a killed
            # worker's socket is closed by its kernel, which is what makes RabbitMQ requeue.
            "heartbeat": 0,
        }


def parse_amqp_url(url: str) -> AmqpQueue:
    parsed = parse_url(url, AMQP_PARAMS)
    parts = urlsplit(url)
    reject_unknown_params(url, [n for n in _query_names(parts.query)], AMQP_PARAMS)
    params = parsed.params
    is_tls = parts.scheme == "celery+amqps"
    queue_type = params.get("queue_type", "classic")
    if queue_type not in ("classic", "quorum"):
        raise InvalidURLError(f"queue_type={queue_type!r} in {redact_url(url)!r}: use classic or quorum")
    max_priority = url_integer(params, "max_priority")
    delivery_limit = url_integer(params, "delivery_limit")
    if queue_type == "quorum" and max_priority is not None:
        raise InvalidURLError("RabbitMQ 3.x quorum queues have no priority: drop max_priority or use classic")
    if queue_type == "classic" and delivery_limit is not None:
        raise InvalidURLError(
            "classic queues have no x-delivery-limit (qworker counts their deliveries itself, "
            "see delivery_store): drop delivery_limit or use queue_type=quorum"
        )
    if max_priority is not None and not 1 <= max_priority <= 255:
        raise InvalidURLError(f"max_priority={max_priority} is not in 1..255")
    if delivery_limit is not None and delivery_limit < 1:
        raise InvalidURLError(f"delivery_limit={delivery_limit} is not >= 1")
    tls: dict[str, Any] | bool | None = None
    if is_tls:
        options: dict[str, Any] = {k.removeprefix("ssl_"): v for k, v in params.items() if k in SSL_PARAMS}
        if "cert_reqs" in options:
            if options["cert_reqs"] not in _CERT_REQS:
                raise InvalidURLError(
                    f"ssl_cert_reqs={options['cert_reqs']!r}: use required, optional or none"
                )
            options["cert_reqs"] = _CERT_REQS[options["cert_reqs"]]
        tls = options or True
    elif SSL_PARAMS & set(params):
        raise InvalidURLError(f"ssl_* parameters need celery+amqps://, not {redact_url(url)!r}")
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    return AmqpQueue(
        host=parts.hostname or "localhost",
        port=parts.port or (DEFAULT_TLS_PORT if is_tls else DEFAULT_PORT),
        userid=unquote(parts.username or "guest"),
        password=unquote(parts.password or "guest"),
        virtual_host=vhost,
        queue=params.get("queue", DEFAULT_QUEUE),
        queue_type=queue_type,  # type: ignore[arg-type]
        max_priority=max_priority,
        delivery_limit=delivery_limit,
        is_declared=url_flag(params, "declare", True),
        delivery_store=params.get("delivery_store"),
        management_url=params.get("management_url"),
        tls=tls,
    )


def _query_names(query: str) -> list[str]:
    from urllib.parse import parse_qsl

    return [k for k, _ in parse_qsl(query, keep_blank_values=True)]
