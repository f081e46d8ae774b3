"""Riding out a broker outage: the backoff schedule, the outage clock, which errors are transient
(each backend's errors.py, read by retry.py and the CLI alike), and the worker loop on an in-memory
source and sink that fail like an unreachable Redis for a while (no model, no Redis server)."""

from __future__ import annotations

import json
import random
from typing import Any

import amqp  # type: ignore[import-untyped]
import botocore.exceptions as boto
import kombu.exceptions
import pytest
import redis

from qworker.backends import BACKENDS
from qworker.backends.errors import backend_errors, backend_packages, translate_error
from qworker.backends.memory.queue import Journal, MemoryQueue, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.cli_errors import connection_problem
from qworker.errors import BrokerConfigurationError, BrokerError, TransientBrokerError
from qworker.health import HealthState
from qworker.jobs.job import JobStatus
from qworker.testing.fake_engine import FakeEngine
from qworker.worker.loop import Worker
from qworker.worker.retry import BrokerOutage, BrokerOutageError, is_transient
from qworker.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(30)


def client_error(code: str, status: int) -> boto.ClientError:
    response: Any = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return boto.ClientError(response, "Op")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_grows_to_its_cap_with_jitter_in_the_upper_half() -> None:
    outage = BrokerOutage(60, base_backoff_s=0.1, max_backoff_s=1.6, rng=random.Random(1))
    for n, full in [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.6), (9, 1.6), (40, 1.6)]:
        waits = [outage.backoff_s(n) for _ in range(200)]
        assert all(full / 2 <= w <= full for w in waits), (n, min(waits), max(waits))
        assert max(waits) - min(waits) > full / 4  # jittered, not fixed


def test_outage_clock_opens_closes_and_gives_up_at_the_limit() -> None:
    clock = FakeClock()
    outage = BrokerOutage(10, clock=clock, rng=random.Random(0))
    assert not outage.is_down and outage.may_try() and not outage.succeeded()
    outage.failed(redis.ConnectionError("refused"), "lease")
    assert outage.is_down and not outage.may_try()
    clock.now += 2.0
    assert outage.may_try()
    outage.failed(redis.ConnectionError("refused"), "lease")
    assert outage.succeeded() and outage.num_outages == 1 and not outage.is_down
    # A new outage starts its own clock.
    outage.failed(redis.TimeoutError("timed out"), "ack")
    clock.now += 9.9
    outage.check_limit()
    clock.now += 0.1
    with pytest.raises(BrokerOutageError, match=r"unreachable for 10\.0s.*ack: TimeoutError"):
        outage.check_limit()
    with pytest.raises(BrokerOutageError):
        outage.failed(redis.ConnectionError("refused"), "ack")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (redis.ConnectionError("refused"), True),
        (redis.TimeoutError("timed out"), True),
        (redis.BusyLoadingError("LOADING Redis is loading the dataset in memory"), True),
        (redis.ReadOnlyError("READONLY You can't write against a read only replica."), True),
        (redis.ResponseError("MASTERDOWN Link with MASTER is down"), True),
        (ConnectionResetError("reset by peer"), True),
        (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
        (redis.ResponseError("NOGROUP No such key"), False),
        # A wrong password is a ConnectionError to redis-py, yet no retry fixes it.
        (redis.AuthenticationError("WRONGPASS invalid username-password pair"), False),
        (ValueError("a bug"), False),
        # botocore's connection errors subclass no builtin: the S3 cancel-flag poll's
        # ConnectionClosedError stopped the worker 7 s into an endpoint cut (issue 37).
        (boto.ConnectionClosedError(endpoint_url="http://127.0.0.1:1/b?list-type=2"), True),
        (boto.EndpointConnectionError(endpoint_url="http://127.0.0.1:1/"), True),
        (boto.ReadTimeoutError(endpoint_url="http://127.0.0.1:1/"), True),
        (boto.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1/"), True),
        (client_error("ThrottlingException", 400), True),
        (client_error("SlowDown", 503), True),
        (client_error("InternalError", 500), True),
        (boto.NoCredentialsError(), False),
        (client_error("AccessDenied", 403), False),
        (client_error("InvalidParameterValue", 400), False),
        (amqp.exceptions.ConnectionForced("broker forced connection closure"), True),
        (amqp.exceptions.AccessRefused("ACCESS_REFUSED - Login was refused"), False),
        (kombu.exceptions.OperationalError("[Errno 111] Connection refused"), True),
    ],
)
def test_which_errors_are_transient(exc: Exception, expected: bool) -> None:
    assert is_transient(exc) is expected


@pytest.mark.parametrize(
    ("exc", "kind", "line"),
    [
        (boto.NoCredentialsError(), BrokerConfigurationError, "no AWS credentials found: boto3 looked in"),
        (
            client_error("QueueDoesNotExist", 400),
            BrokerConfigurationError,
            "the service answered QueueDoesNotExist",
        ),
        (client_error("NoSuchBucket", 404), BrokerConfigurationError, "the service answered NoSuchBucket"),
        (
            client_error("InvalidParameterValue", 400),
            BrokerError,
            "the service answered InvalidParameterValue",
        ),
        (boto.EndpointConnectionError(endpoint_url="http://h:1/"), TransientBrokerError, "Could not connect"),
        (
            redis.AuthenticationError("WRONGPASS"),
            BrokerConfigurationError,
            "the server refused the credentials",
        ),
        (redis.ConnectionError("Error 111"), TransientBrokerError, "Error 111"),
        (
            amqp.exceptions.AccessRefused("Login was refused"),
            BrokerConfigurationError,
            "RabbitMQ refused the login",
        ),
        (ConnectionResetError("reset by peer"), TransientBrokerError, "reset by peer"),
    ],
)
def test_one_translation_for_the_loop_and_the_cli(exc: Exception, kind: type, line: str) -> None:
    translated = translate_error(exc)
    assert type(translated) is kind and translated.__cause__ is exc
    # The CLI's line for an exit code is the same translation's message.
    problem = connection_problem(exc)
    assert problem == str(translated) and problem.startswith(line), problem
    assert is_transient(exc) is (kind is TransientBrokerError)


def test_a_bug_is_no_store_failure() -> None:
    for exc in (ValueError("a bug"), KeyError("k"), redis.ResponseError("WRONGTYPE")):
        assert translate_error(exc) is None and connection_problem(exc) is None


def test_every_backend_package_reads_its_own_library_errors() -> None:
    packages = backend_packages()
    assert set(packages) == set(BACKENDS.values())
    for package in packages:
        errors = backend_errors(package)
        assert all(isinstance(name, str) for name in errors.libraries), package
        assert errors.translate(ValueError("a bug")) is None, package


# -- the loop ---------------------------------------------------------------------------------


class Broker:
    """Up or down; a proxy's calls raise redis.ConnectionError while it is down."""

    def __init__(self) -> None:
        self.is_down = False
        self.num_refused = 0


class Flaky:
    def __init__(self, target: Any, broker: Broker) -> None:
        self._target = target
        self._broker = broker

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value) or name in ("close",):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._broker.is_down:
                self._broker.num_refused += 1
                raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
            return value(*args, **kwargs)

        return call


def make_worker(
    broker: Broker, engine: FakeEngine, **settings: Any
) -> tuple[Worker, MemoryQueue, MemoryResultSink, Journal]:
    journal: Journal = []
    queue = MemoryQueue("jobs")
    source = MemorySource(queue, consumer="w1", journal=journal)
    sink = MemoryResultSink(journal)
    defaults: dict[str, Any] = dict(
        name="w1", max_backlog=4, poll_interval_s=0.01, cancel_check_interval_s=0.0
    )
    worker = Worker(
        engine,
        Flaky(source, broker),  # type: ignore[arg-type]
        Flaky(sink, broker),  # type: ignore[arg-type]
        WorkerSettings(**{**defaults, **settings}),
        health=HealthState(),
    )
    return worker, queue, sink, journal


def put_jobs(queue: MemoryQueue, n: int, max_tokens: int = 12) -> list[str]:
    body = {"prompt": "hello", "params": {"max_tokens": max_tokens, "temperature": 0.0}}
    for i in range(n):
        queue.put(json.dumps(body).encode(), f"j{i}")
    return [f"j{i}" for i in range(n)]


def test_the_engine_keeps_stepping_through_an_outage_and_every_job_ends_once() -> None:
    broker = Broker()
    engine = FakeEngine()
    worker, queue, sink, journal = make_worker(broker, engine)
    ids = put_jobs(queue, 6)
    readiness: list[tuple[bool, str]] = []

    def on_step(step: int) -> None:
        if step == 3:
            broker.is_down = True
        if broker.is_down:
            readiness.append(worker.health.readiness())
        if step == 9:
            broker.is_down = False

    engine.on_step = on_step
    stats = worker.run(burst=True)
    assert broker.num_refused > 0
    assert stats.num_broker_outages >= 1
    assert readiness and not readiness[-1][0] and "broker unreachable" in readiness[-1][1]
    assert worker.health.readiness() == (True, "ok")
    for job_id in ids:
        result = sink.get_result(job_id)
        assert result is not None and result.status is JobStatus.COMPLETED
        assert result.attempts == 1 and result.text == "abcdefghijkl"
        events = [e for e, subject in journal if subject == job_id]
        # One result, then one ack; never an ack before its result.
        assert events.count("result") == 1 and events.count("ack") == 1
        assert events.index("result") < events.index("ack")
    assert stats.num_completed == len(ids)
    assert queue.depth() == 0


def test_an_outage_past_the_limit_frees_the_engine_and_raises() -> None:
    broker = Broker()
    engine = FakeEngine()
    worker, queue, sink, _ = make_worker(broker, engine, broker_outage_s=0.5)
    put_jobs(queue, 3, max_tokens=10_000 // 100)

    def on_step(step: int) -> None:
        if step == 2:
            broker.is_down = True

    engine.on_step = on_step
    with pytest.raises(BrokerOutageError, match=r"past the limit of [01]s"):
        worker.run(burst=True)
    assert not engine.has_unfinished_requests()
    assert worker.num_jobs_held == 0
    assert not any(sink.get_result(f"j{i}") for i in range(3))
