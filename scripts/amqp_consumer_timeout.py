"""RabbitMQ's consumer_timeout on a qworker lease: a private node with a 3 s consumer_timeout, one
job leased and held unacked past it. The broker closes the channel (on RabbitMQ 3.10 at its next
check, about 60 s later), the source's lease check reports the lease lost, the message is back in
the queue (redelivered), and a new lease on a new channel takes and acks it.

    python scripts/amqp_consumer_timeout.py      # about 75 s; needs rabbitmq-server installed

Not in the test suite because of the broker's 60 s check interval.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qworker.backends.connections import open_producer, open_source
from qworker.backends.source import OutgoingJob
from tests.integration.celery_rabbitmq_support import amqp_url, new_queue
from tests.integration.rabbitmq_node import RabbitNode


def main() -> None:
    node = RabbitNode(consumer_timeout_ms=3000).start()
    try:
        url = amqp_url(node.port, new_queue("consumer-timeout"))
        producer = open_producer(url)
        producer.send([OutgoingJob("a", b'{"prompt": "x"}'), OutgoingJob("b", b'{"prompt": "y"}')])
        source = open_source(url, "c")
        (lease,) = source.lease(1, 1.0)
        started = time.time()
        while time.time() - started < 120 and not source.extend([lease]):
            time.sleep(1)
        lost_after = time.time() - started
        ready = producer.queue_depth()
        leases = source.lease(2, 1.0)
        for held in leases:
            source.ack(held)
        source.extend(leases)  # a round trip: the acks are processed
        print(f"lease lost after {lost_after:.1f} s; ready then: {ready}")
        print("leased again (job id, delivery count):", [(le.job_id, le.delivery_count) for le in leases])
        print("ready after the acks:", producer.queue_depth())
        assert ready == 2 and sorted(le.job_id for le in leases) == ["a", "b"] and producer.queue_depth() == 0
        source.close()
        producer.close()
    finally:
        node.close()


if __name__ == "__main__":
    main()
