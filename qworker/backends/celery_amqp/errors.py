"""Celery on RabbitMQ: py-amqp's failures (and kombu's, from the producer) as qworker reads them.

- configuration: ACCESS_REFUSED (a login or a vhost refused) and a queue declared otherwise or
  missing (broker.py raises AmqpQueueMismatch, one of these);
- transient: every other AMQP error (a connection or channel closed: a broker restart, a reset,
  consumer_timeout on an old delivery) and socket errors, kombu's OperationalError too. The
  channel is reset when it fails (broker.py), and the next call reconnects.
"""

from __future__ import annotations

import sys

from qworker.errors import BrokerConfigurationError, BrokerError, TransientBrokerError

LIBRARIES = ("amqp", "kombu")


def translate_error(exc: BaseException) -> BrokerError | None:
    if "amqp" in sys.modules:
        import amqp  # type: ignore[import-untyped]

        if isinstance(exc, amqp.exceptions.AccessRefused):
            return BrokerConfigurationError(f"RabbitMQ refused the login or vhost: {exc}")
        if isinstance(exc, amqp.exceptions.AMQPError):
            return TransientBrokerError(f"RabbitMQ: {exc}")
    if "kombu" in sys.modules:
        from kombu.exceptions import OperationalError

        if isinstance(exc, OperationalError):
            return TransientBrokerError(str(exc) or type(exc).__name__)
    return None


def translate_call_error(exc: BaseException, what: str) -> BrokerError:
    """What broker.py raises when `what` (a call on the channel) failed with an AMQP or socket
    error: transient unless the broker refused the login."""
    translated = translate_error(exc)
    if isinstance(translated, BrokerConfigurationError):
        return translated
    return TransientBrokerError(f"RabbitMQ: {what}: {exc}")
