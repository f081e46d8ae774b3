"""One connection and channel to RabbitMQ (py-amqp, kombu's pyamqp transport), the queue
declarations, and the mapping of broker failures onto what the worker loop retries.

- Declaring: the job queue with `AmqpQueue.queue_arguments()` (durable), its direct exchange of
  the same name (as Celery declares it), and the dead-letter exchange and queue `{queue}.dead`.
  With declare=false a passive declare only checks that the job queue exists (the dead-letter
  exchange and queue, qworker's own, are still declared). A queue that exists
  with other arguments is PRECONDITION_FAILED: raised as AmqpQueueMismatch, naming the arguments
  qworker wanted, since no retry can fix it.
- Generations: a channel that closes (broker restart, connection reset, RabbitMQ's
  consumer_timeout on a delivery left unacked too long) takes its unacked deliveries with it, and
  the broker requeues them. Each channel gets a new generation number; a delivery tag is only
  meaningful with its generation, and a lease of an older generation is lost (extend says so).
- Errors: a connection or channel failure resets the channel and is raised as qworker's
  TransientBrokerError (errors.py reads it), which the loop treats as a broker outage: it backs
  off, and the next call reconnects. A refused login is a BrokerConfigurationError instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from qworker.backends.celery_amqp.errors import translate_call_error
from qworker.backends.celery_amqp.url import AmqpQueue
from qworker.errors import BrokerConfigurationError

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Celery's remote-control broadcast exchange (kombu.pidbox.Mailbox: fanout, not durable).
PIDBOX_EXCHANGE = "celery.pidbox"


class AmqpQueueMismatch(BrokerConfigurationError):
    """The queue exists with other arguments than the URL's (RabbitMQ's PRECONDITION_FAILED), or
    does not exist under declare=false."""


class AmqpBroker:
    def __init__(self, config: AmqpQueue, *, listen_for_revokes: bool = False) -> None:
        self.config = config
        self.listen_for_revokes = listen_for_revokes
        self.generation = 0
        self.revoke_queue: str | None = None
        self._connection: Any = None
        self._channel: Any = None

    @property
    def is_open(self) -> bool:
        return self._channel is not None

    def channel(self) -> Any:
        if self._channel is None:
            self._open()
        return self._channel

    def _open(self) -> None:
        import amqp  # type: ignore[import-untyped]

        connection = amqp.Connection(**self.config.connect_kwargs())
        try:
            connection.connect()
            channel = connection.channel()
            # Bodies stay bytes: a body is decoded only once its content type is known to be JSON.
            channel.auto_decode = False
            self._declare(channel)
            if self.listen_for_revokes:
                channel.exchange_declare(PIDBOX_EXCHANGE, "fanout", durable=False, auto_delete=False)
                self.revoke_queue = channel.queue_declare("", exclusive=True, auto_delete=True).queue
                channel.queue_bind(self.revoke_queue, PIDBOX_EXCHANGE)
        except BaseException:
            _close_quietly(connection)
            raise
        self._connection, self._channel = connection, channel
        self.generation += 1

    def _declare(self, channel: Any) -> None:
        import amqp  # type: ignore[import-untyped]

        c = self.config
        try:
            if c.is_declared:
                channel.exchange_declare(c.queue, "direct", durable=True, auto_delete=False)
                channel.queue_declare(c.queue, durable=True, auto_delete=False, arguments=c.queue_arguments())
                channel.queue_bind(c.queue, c.queue, routing_key=c.queue)
            else:
                channel.queue_declare(c.queue, passive=True)
            # qworker's own: declared either way, so that a dead letter always has somewhere to go.
            channel.exchange_declare(c.dead_letter, "direct", durable=True, auto_delete=False)
            channel.queue_declare(c.dead_letter, durable=True, auto_delete=False)
            channel.queue_bind(c.dead_letter, c.dead_letter, routing_key=c.dead_letter)
        except amqp.exceptions.PreconditionFailed as exc:
            raise AmqpQueueMismatch(
                f"RabbitMQ's queue {c.queue!r} exists with other arguments than qworker declares "
                f"({c.queue_arguments()}): {exc}. Give the URL the queue's own queue_type, "
                "max_priority and delivery_limit (and Celery the task_queues of docs/WORKER.md), "
                "or use declare=false"
            ) from exc
        except amqp.exceptions.NotFound as exc:
            raise AmqpQueueMismatch(f"RabbitMQ has no queue {c.queue!r} (declare=false): {exc}") from exc

    def reset(self) -> None:
        """Drop the channel and connection (the broker requeues what they held unacked)."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            _close_quietly(connection)

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        """`fn(channel)`; a broker failure resets the channel and raises TransientBrokerError (a
        refused login: BrokerConfigurationError)."""
        import amqp  # type: ignore[import-untyped]

        try:
            return fn(self.channel())
        except AmqpQueueMismatch:
            self.reset()
            raise
        except (amqp.exceptions.AMQPError, OSError) as exc:
            # A channel error (consumer_timeout's PRECONDITION_FAILED on an old delivery among
            # them) closes the channel; a connection error the connection. Either way: anew.
            logger.warning("RabbitMQ: %s failed (%s: %s); reconnecting", what, type(exc).__name__, exc)
            self.reset()
            raise translate_call_error(exc, what) from exc

    def close(self) -> None:
        self.reset()


def _close_quietly(connection: Any) -> None:
    try:
        connection.close()
    except Exception:
        with contextlib.suppress(Exception):
            connection.collect()
