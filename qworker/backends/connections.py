"""Open a queue's source or producer, a result store, a backlog reader or a dead-letter queue
from its URL, through the backend table (backends/__init__.py).

    redis://host:port/db?stream=...&group=...&lease_timeout_s=...      job source
    redis://host:port/db?prefix=...&result_ttl_s=...&delta_ttl_s=...   result store
    rediss://..., unix:///path/redis.socket?...                         same, over TLS or a unix socket
    (none)                                                              the embedded Redis server

    sqs://QUEUE?region=...&endpoint_url=...&dead_letter=...&lease_timeout_s=...&payload_s3=s3://b/p
                                                                        job source (AWS SQS)
    s3://bucket/prefix?region=...&endpoint_url=...&conditional_put=true   result store (AWS S3)
    celery+redis://host:port/db?queue=qworker&lease_timeout_s=...        job source (Celery messages)
                                                                        and, as results, Celery's
                                                                        Redis result backend
    celery+amqp://user:pw@host:5672/vhost?queue=qworker&max_priority=...  job source (Celery messages
                                                                        on RabbitMQ; results: --results
                                                                        celery+redis://...), also amqps
    memory://NAME                                                       both, in this process only

Final results and the live token stream may go to different stores: open_sink(results,
stream_results) (see backends/split_sink.py). AWS credentials come from boto3's standard chain.

Credentials and TLS: redis://user:password@host:port/db (or redis://:password@...) authenticates;
rediss://... connects over TLS, with redis-py's ssl_* query parameters passed through, e.g.
rediss://:pw@host:6380/0?ssl_ca_certs=/etc/ssl/ca.pem or ?ssl_cert_reqs=none. A query parameter
that neither qworker nor the client library takes is an InvalidURLError that lists the accepted
ones. Whatever is logged or shown goes through redact_url first (urls.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qworker.backends import backend_for, schemes_providing
from qworker.backends.aws import aws_client, aws_parts, aws_retries, s3_location_of_results
from qworker.backends.redis.connection import SINK_PARAMS, SOURCE_PARAMS, parse_redis_url, redis_client
from qworker.backends.urls import InvalidURLError, ParsedURL, parse_url, redact_url, schemes_text, url_scheme

if TYPE_CHECKING:
    from qworker.backends.backlog import Backlog
    from qworker.backends.dead_letters import DeadLetterQueue
    from qworker.backends.sink import ResultSink
    from qworker.backends.source import JobProducer, JobSource
    from qworker.pool.demand import PoolSizing

# Names callers outside the worker import from here (the URL helpers live in urls.py and the
# backend packages; this module is where a caller opens things from a URL).
__all__ = [
    "SINK_PARAMS",
    "SOURCE_PARAMS",
    "InvalidURLError",
    "ParsedURL",
    "aws_client",
    "aws_parts",
    "aws_retries",
    "default_results_url",
    "open_backlog",
    "open_dead_letters",
    "open_producer",
    "open_sink",
    "open_source",
    "parse_redis_url",
    "parse_url",
    "queue_schemes",
    "redact_url",
    "redis_client",
    "resolve_url",
    "result_schemes",
    "s3_location_of_results",
    "schemes_text",
]


def queue_schemes() -> tuple[str, ...]:
    """URL schemes a job queue can use, e.g. for help text."""
    return schemes_providing("open_source")


def result_schemes() -> tuple[str, ...]:
    """URL schemes a result store can use."""
    return schemes_providing("open_sink")


def open_source(url: str | None, consumer: str, lease_timeout_s: float | None = None) -> JobSource:
    """The job source at `url` (none: the embedded Redis), read as `consumer`. `lease_timeout_s`
    overrides the URL's."""
    url = resolve_url(url)
    opener = backend_for(url, "open_source").open_source
    assert callable(opener), "backend_for checked the part"
    return opener(url, consumer, lease_timeout_s)


def open_producer(url: str | None, payload_location: str | None = None) -> JobProducer:
    """The sending side of a queue URL. `payload_location` (s3://bucket/prefix) is where an SQS
    producer puts jobs too large for a message, unless the URL's `payload_s3` says otherwise."""
    url = resolve_url(url)
    opener = backend_for(url, "open_producer").open_producer
    assert callable(opener), "backend_for checked the part"
    return opener(url, payload_location)


def open_sink(url: str | None, stream_url: str | None = None) -> ResultSink:
    """The result store at `url`; with `stream_url`, live deltas and job notes (cancel flags, last
    errors, stats) go there instead ("stream to X, final to Y")."""
    if stream_url:
        from qworker.backends.split_sink import SplitSink

        return SplitSink(final=open_sink(url), stream=open_sink(stream_url))
    url = resolve_url(url)
    opener = backend_for(url, "open_sink").open_sink
    assert callable(opener), "backend_for checked the part"
    return opener(url)


def open_backlog(url: str, sizing: PoolSizing, lease_timeout_s: float | None = None) -> Backlog:
    """What the queue at `url` holds, in jobs and KV blocks (for the pool-demand exporter)."""
    opener = backend_for(url, "open_backlog").open_backlog
    assert callable(opener), "backend_for checked the part"
    return opener(url, sizing, lease_timeout_s)


def open_dead_letters(url: str | None) -> DeadLetterQueue:
    """The dead letters of the job queue at `url` (none: the embedded Redis)."""
    url = resolve_url(url)
    opener = backend_for(url, "open_dead_letters").open_dead_letters
    assert callable(opener), "backend_for checked the part"
    return opener(url)


def default_results_url(queue_url: str) -> str:
    """The results store when none is given: the queue's own server, when it can store results."""
    # An unknown scheme is named as such, as opening the queue would.
    backend_for(queue_url, "open_source")
    if url_scheme(queue_url) not in result_schemes():
        raise InvalidURLError(
            f"a {url_scheme(queue_url)}:// queue needs a results URL ({schemes_text(result_schemes())}); "
            "pass --results"
        )
    return queue_url


def resolve_url(url: str | None) -> str:
    """`url`, or the embedded Redis server's URL when none is given."""
    if url:
        return url
    from qworker.backends.redis.embedded import embedded_redis_url

    return embedded_redis_url()
