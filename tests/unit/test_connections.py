"""Opening URLs through the backend table (qworker.backends.BACKENDS, used by
qworker.backends.connections): each scheme opens its class, errors list what the table holds, and
URL query parameters nobody takes are an InvalidURLError.

Sinks open without connecting (redis-py and boto3 connect at the first command); the Redis
sources create their consumer group, so they use the Redis server of the tests (a unique stream
each, deleted afterwards), and the SQS source asks moto's server for its queue.
"""

from __future__ import annotations

import socket
import uuid

import pytest

from qworker.backends import BACKENDS, connections
from qworker.backends.celery.producer import CeleryProducer
from qworker.backends.celery.results import CeleryResultSink
from qworker.backends.celery.source import CelerySource
from qworker.backends.connections import (
    InvalidURLError,
    default_results_url,
    open_producer,
    open_sink,
    open_source,
    queue_schemes,
    result_schemes,
)
from qworker.backends.memory.queue import MemoryProducer, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.backends.redis.producer import RedisStreamProducer
from qworker.backends.redis.results import RedisResultSink
from qworker.backends.redis.streams import RedisStreamSource
from qworker.backends.s3.results import S3ResultSink
from qworker.testing.worker_kit import redis_base_url

AWS = "region=us-east-1&endpoint_url=http://127.0.0.1:9"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("url", "sink_class"),
    [
        ("redis://127.0.0.1:6379/0?prefix=p", RedisResultSink),
        ("rediss://127.0.0.1:6380/0?ssl_cert_reqs=none", RedisResultSink),
        ("unix:///tmp/qworker-test-none.sock?prefix=p", RedisResultSink),
        (f"s3://bucket/prefix?{AWS}", S3ResultSink),
        ("celery+redis://127.0.0.1:6379/0?queue=q", CeleryResultSink),
        ("celery+rediss://127.0.0.1:6380/0?ssl_cert_reqs=none", CeleryResultSink),
        ("memory://results-test", MemoryResultSink),
    ],
)
def test_every_result_scheme_opens_its_sink(url, sink_class):
    sink = open_sink(url)
    assert type(sink) is sink_class


def test_the_result_cases_cover_the_table():
    # The cluster and Sentinel schemes connect when opened: their sinks are opened on real ones
    # in tests/integration/test_redis_cluster.py and test_redis_sentinel.py.
    topologies = {"redis+cluster", "rediss+cluster", "redis+sentinel"}
    covered = {"redis", "rediss", "unix", "s3", "celery+redis", "celery+rediss", "memory"} | topologies
    assert set(result_schemes()) == covered
    # celery+amqp(s) connect when opened too: tests/integration/test_celery_rabbitmq.py opens them.
    rabbitmq = {"celery+amqp", "celery+amqps"}
    queue_cases = (
        {"redis", "rediss", "unix", "sqs", "celery+redis", "celery+rediss", "memory"} | topologies | rabbitmq
    )
    assert set(queue_schemes()) == queue_cases


@pytest.fixture
def redis_url():
    import redis

    base = redis_base_url()
    name = f"qwtest:conn:{uuid.uuid4().hex[:10]}"
    yield f"{base}?stream={name}&group=g&prefix={name}", name
    client = redis.Redis.from_url(base)
    for pattern in (f"{name}*", f"_kombu.binding*{name}*"):
        for key in client.scan_iter(match=pattern):
            client.delete(key)
    client.close()


@pytest.mark.timeout(30)
def test_queue_schemes_open_their_sources_and_producers(redis_url):
    url, name = redis_url
    source = open_source(url, consumer="c1", lease_timeout_s=7)
    assert type(source) is RedisStreamSource
    assert (source.stream, source.lease_timeout_s) == (name, 7)
    assert type(open_producer(url)) is RedisStreamProducer

    celery_url = "celery+" + url.split("?")[0] + f"?queue={name}.celery"
    assert type(open_source(celery_url, consumer="c1")) is CelerySource
    assert type(open_producer(celery_url)) is CeleryProducer

    memory_source = open_source("memory://conn-test?lease_timeout_s=5", consumer="c1")
    assert type(memory_source) is MemorySource
    assert memory_source.lease_timeout_s == 5
    assert type(open_producer("memory://conn-test")) is MemoryProducer
    # rediss, unix and celery+rediss differ from their plain forms only in redis-py's connection
    # class, which sink tests above cover without a TLS server or a socket.
    assert BACKENDS["rediss"] == BACKENDS["unix"] == BACKENDS["redis"]
    assert BACKENDS["celery+rediss"] == BACKENDS["celery+redis"]


@pytest.mark.timeout(60)
def test_sqs_scheme_opens_an_sqs_source():
    import boto3
    from moto.server import ThreadedMotoServer

    from qworker.backends.sqs.producer import SqsProducer
    from qworker.backends.sqs.source import SqsSource

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            endpoint = f"http://127.0.0.1:{port}"
            sqs = boto3.session.Session().client("sqs", region_name="us-east-1", endpoint_url=endpoint)
            sqs.create_queue(QueueName="conn-test")
            url = f"sqs://conn-test?region=us-east-1&endpoint_url={endpoint}&lease_timeout_s=9"
            source = open_source(url, consumer="c1")
            assert type(source) is SqsSource
            assert source.lease_timeout_s == 9
            assert type(open_producer(url)) is SqsProducer
    finally:
        server.stop()


def test_unknown_scheme_lists_the_table(monkeypatch):
    with pytest.raises(InvalidURLError) as info:
        open_source("amqp://guest@host//", consumer="c")
    for scheme in queue_schemes():
        assert f"{scheme}://" in str(info.value)
    assert "'amqp'" in str(info.value)
    with pytest.raises(InvalidURLError) as info:
        open_sink("sqs://jobs")
    for scheme in result_schemes():
        assert f"{scheme}://" in str(info.value)
    with pytest.raises(InvalidURLError, match="has no scheme"):
        open_sink("/just/a/path")
    # One line adds a backend; the messages follow the table.
    monkeypatch.setitem(BACKENDS, "inproc", "qworker.backends.memory")
    assert type(open_source("inproc://q", consumer="c")) is MemorySource
    with pytest.raises(InvalidURLError, match="inproc://"):
        open_source("amqp://host", consumer="c")


def test_default_results_url_follows_the_table():
    assert default_results_url("redis://h:1/0?stream=s") == "redis://h:1/0?stream=s"
    with pytest.raises(InvalidURLError) as info:
        default_results_url("sqs://jobs")
    assert "needs a results URL" in str(info.value)
    for scheme in result_schemes():
        assert f"{scheme}://" in str(info.value)
    # A scheme no backend serves is named as unknown, as opening the queue names it (issue 29).
    with pytest.raises(InvalidURLError) as info:
        default_results_url("foo://bar")
    assert "unsupported queue URL scheme 'foo'" in str(info.value)
    for scheme in queue_schemes():
        assert f"{scheme}://" in str(info.value)


def test_schemes_text():
    assert connections.schemes_text(["redis"]) == "redis://"
    assert connections.schemes_text(["redis", "sqs", "memory"]) == "redis://, sqs:// or memory://"


@pytest.mark.parametrize("opener", ["source", "sink", "producer"])
def test_unknown_redis_parameter_is_named_with_the_accepted_ones(opener):
    url = "redis://:hunter2@127.0.0.1:6379/0?steam=jobs"
    with pytest.raises(InvalidURLError) as info:
        if opener == "source":
            open_source(url, consumer="c")
        elif opener == "sink":
            open_sink(url)
        else:
            open_producer(url)
    message = str(info.value)
    assert "'steam'" in message
    for accepted in ("stream", "group", "prefix", "socket_timeout", "health_check_interval"):
        assert accepted in message
    assert "hunter2" not in message


def test_redis_parameters_pass_through_to_redis_py():
    sink = open_sink("redis://127.0.0.1:6379/0?prefix=p&socket_timeout=3&health_check_interval=7")
    assert isinstance(sink, RedisResultSink)
    kwargs = sink.redis.connection_pool.connection_kwargs
    assert (kwargs["socket_timeout"], kwargs["health_check_interval"]) == (3.0, 7)
    assert sink.prefix == "p"
    # TLS options exist only for rediss://: redis-py's plain connection would reject them later.
    with pytest.raises(InvalidURLError, match="'ssl_cert_reqs'"):
        open_sink("redis://127.0.0.1:6379/0?ssl_cert_reqs=none")
    sink = open_sink("rediss://127.0.0.1:6380/0?ssl_cert_reqs=none&ssl_check_hostname=false")
    assert isinstance(sink, RedisResultSink)
    assert sink.redis.connection_pool.connection_kwargs["ssl_cert_reqs"] == "none"


def test_unknown_parameters_of_other_backends():
    with pytest.raises(InvalidURLError, match=r"'socket_timeout'.*kombu's: ssl_\*"):
        open_source("celery+redis://127.0.0.1:6379/0?socket_timeout=3", consumer="c")
    with pytest.raises(InvalidURLError, match="'quue'"):
        open_sink("celery+redis://127.0.0.1:6379/0?quue=q")
    with pytest.raises(InvalidURLError, match="'bucket_region'"):
        open_sink(f"s3://bucket/prefix?{AWS}&bucket_region=x")
    with pytest.raises(InvalidURLError, match=r"'sream'.*lease_timeout_s"):
        open_source("memory://q?sream=x", consumer="c")
    with pytest.raises(InvalidURLError, match="is not a number"):
        open_source("memory://q?lease_timeout_s=soon", consumer="c")
