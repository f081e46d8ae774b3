"""Celery on RabbitMQ: a real celery.Celery app sends to a RabbitMQ node that this module starts
(its own port, node name and data directory; the machine's shared server is never used), a
qworker worker serves the queue, and the app reads results with AsyncResult.get() from its Redis
result backend (the suite's Redis server, database 12). The app's task_queues are those of docs/WORKER.md.

Covered: results, a validation FAILURE with its reason, a pickled task dead-lettered unread and
`qworker dlq` list/replay/purge on it, revoke / expires / countdown / time_limit, priority on a
classic x-max-priority queue, delivery counts (quorum x-delivery-count, classic in the store),
hostile raw AMQP messages, a queue declared with other arguments, the backlog, and amqps://.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from qworker.backends.celery_amqp.broker import AmqpQueueMismatch
from qworker.backends.connections import (
    open_backlog,
    open_dead_letters,
    open_producer,
    open_sink,
    open_source,
)
from qworker.backends.source import OutgoingJob
from qworker.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine
from qworker.pool.demand import PoolSizing
from qworker.pool.exporter import open_pool_demand_reader
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from tests.integration import rabbitmq_node
from tests.integration.celery_rabbitmq_support import (
    RESULTS,
    RESULTS_REDIS,
    TASK,
    amqp_url,
    celery_app,
    celery_headers,
    forget,
    new_queue,
    publish_raw,
    queue_counts,
    results_redis,
    task_queue,
)
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.skipif(not rabbitmq_node.is_available(), reason="needs rabbitmq-server installed")


@pytest.fixture(scope="module")
def node():
    node = rabbitmq_node.RabbitNode(with_tls=True).start()
    yield node
    node.close()


@pytest.fixture(scope="module")
def store():
    r = results_redis()
    if r is None:
        pytest.fail("the suite's Redis server (the Celery result backend) does not answer")
    return r


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=16
        )
    )


def job(max_tokens: int, first: int = 5) -> dict:
    return {"prompt_token_ids": [first, 6, 7], "params": {"max_tokens": max_tokens, "ignore_eos": True}}


def make_worker(engine, url: str, name: str = "w", **settings) -> Worker:
    return Worker(
        engine, open_source(url, consumer=name), open_sink(RESULTS), WorkerSettings(name=name, **settings)
    )


class PlantsAFile:
    """Unpickling this creates a file: proof that a payload was deserialized."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.timeout(120)
def test_celery_app_results_failure_pickle_and_dlq(node, store, engine, tmp_path):
    queue = new_queue("e2e")
    app = celery_app(node.url, [task_queue(queue, max_priority=10)], accept_pickle=True)
    url = amqp_url(node.port, queue, max_priority=10)
    marker = tmp_path / "pwned"
    jobs = [job(2 + i % 4, first=5 + i) for i in range(20)]
    sent = [app.send_task(TASK, kwargs=j, queue=queue) for j in jobs]
    unknown = app.send_task(TASK, kwargs={"prompt": "x", "bogus": 1}, queue=queue)
    bad = app.send_task(TASK, kwargs={"prompt": "x", "params": {"max_tokens": 0}}, queue=queue)
    evil = app.send_task(TASK, kwargs={"prompt": PlantsAFile(str(marker))}, queue=queue, serializer="pickle")
    stats = make_worker(engine, url).run(burst=True)
    try:
        assert not marker.exists(), "the pickle payload was deserialized"
        for j, result in zip(jobs, sent, strict=True):
            value = result.get(timeout=30)
            assert value["id"] == result.id and value["status"] == "completed"
            assert len(value["token_ids"]) == j["params"]["max_tokens"]
        with pytest.raises(Exception) as raised:
            unknown.get(timeout=10)
        assert type(raised.value).__name__ == "ValidationError" and "bogus: unknown field" in str(
            raised.value
        )
        with pytest.raises(Exception) as raised:
            bad.get(timeout=10)
        assert bad.state == "FAILURE" and "max_tokens" in str(raised.value)
        with pytest.raises(Exception) as raised:
            evil.get(timeout=10)
        assert type(raised.value).__name__ == "Rejected" and "not accepted" in str(raised.value)
        assert stats.num_completed == 20 and stats.num_dead_lettered == 1
        assert queue_counts(node.port, queue) == 0  # all acked

        # qworker dlq: the pickled message, unread, with its reason; replay puts it back, purge.
        dlq = open_dead_letters(url)
        letters = dlq.read()
        assert [d.id for d in letters] == [evil.id] and "not accepted" in letters[0].reason
        assert letters[0].attempts == 1 and letters[0].dead_at is not None
        assert dlq.read()[0].id == evil.id  # reading gave it back
        listed = subprocess.run(
            [sys.executable, "-m", "qworker", "dlq", "list", "--queue", url, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert listed.returncode == 0, listed.stderr
        (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert row["id"] == evil.id and "not accepted" in row["reason"]
        assert [d.id for d in dlq.replay(None, open_sink(RESULTS))] == [evil.id]
        assert queue_counts(node.port, queue) == 1 and dlq.read() == []
        assert make_worker(engine, url).run(burst=True).num_dead_lettered == 1  # refused again
        assert not marker.exists()
        assert dlq.purge() == 1 and dlq.read() == []
        dlq.close()
    finally:
        forget(store, [r.id for r in (*sent, unknown, bad, evil)])
        app.close()


class SlowEngine:
    """The real engine with a pause per step, so a long job is still running when the test acts."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def step(self):
        time.sleep(0.02)
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.timeout(120)
def test_expires_countdown_time_limit_and_revoke(node, store, engine):
    queue = new_queue("controls")
    app = celery_app(node.url, [task_queue(queue)])
    url = amqp_url(node.port, queue)
    worker = make_worker(SlowEngine(engine), url)  # declares the queue and its dead-letter exchange
    # On RabbitMQ, Celery turns `expires` into the message's TTL (`expiration`; 0 when past): the
    # broker drops an expired message itself, to the dead-letter exchange (x-death "expired").
    expired = app.send_task(
        TASK, kwargs=job(3), queue=queue, expires=datetime.now(UTC) - timedelta(seconds=30)
    )
    eta_sent_at = time.time()
    delayed = app.send_task(TASK, kwargs=job(3, first=8), queue=queue, countdown=3)
    quick = app.send_task(TASK, kwargs=job(3, first=9), queue=queue)
    limited = app.send_task(TASK, kwargs=job(400, first=10), queue=queue, time_limit=1)
    victim = app.send_task(TASK, kwargs=job(400, first=11), queue=queue)
    dlq = open_dead_letters(url)
    wait_for(lambda: [d.id for d in dlq.read()] == [expired.id], 20, "the broker to expire a task")
    assert "expired" in dlq.read()[0].reason
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: store.exists(f"qworker:deltas:{victim.id}"), 30, "the victim to start")
        revoked_at = time.monotonic()
        app.control.revoke(victim.id)
        wait_for(lambda: victim.state == "REVOKED", 10, "the revoked task to be REVOKED")
        assert time.monotonic() - revoked_at < 3.0
        meta = victim.backend.get_task_meta(victim.id)["qworker_result"]
        assert meta["status"] == "cancelled" and meta["usage"]["completion_tokens"] < 400
        wait_for(lambda: limited.state == "FAILURE", 30, "the time-limited task to fail")
        assert type(limited.result).__name__ == "TimeLimitExceeded"
        quick_result = quick.get(timeout=30)
        delayed_result = delayed.get(timeout=30)
        assert delayed_result["timings"]["started_at"] >= eta_sent_at + 3 - 0.05
        assert quick_result["timings"]["finished_at"] < delayed_result["timings"]["started_at"]
    finally:
        worker.stop()
        thread.join(timeout=60)
        forget(store, [r.id for r in (expired, delayed, quick, limited, victim)])
        dlq.purge()
        dlq.close()
        app.close()
    assert not thread.is_alive() and queue_counts(node.port, queue) == 0


@pytest.mark.timeout(120)
def test_urgent_tasks_start_before_the_normal_backlog(node, store, engine):
    """5 tasks with priority 9 sent behind 100 with priority 0, on a classic x-max-priority queue:
    the broker delivers them first, so all 5 start before all but at most one pull (max_backlog
    jobs) of the normal ones. The bound: at most max_backlog normal tasks start before the last
    urgent one."""
    queue = new_queue("priority")
    app = celery_app(node.url, [task_queue(queue, max_priority=10)])
    url = amqp_url(node.port, queue, max_priority=10)
    normal = [app.send_task(TASK, kwargs=job(2, first=20 + i % 50), queue=queue) for i in range(100)]
    urgent = [app.send_task(TASK, kwargs=job(2, first=90), queue=queue, priority=9) for _ in range(5)]
    max_backlog = 4
    try:
        make_worker(engine, url, max_backlog=max_backlog).run(burst=True)
        normal_starts = [r.get(timeout=30)["timings"]["started_at"] for r in normal]
        last_urgent = max(r.get(timeout=30)["timings"]["started_at"] for r in urgent)
        num_normal_before = sum(1 for t in normal_starts if t < last_urgent)
        assert num_normal_before <= max_backlog, f"{num_normal_before} normal tasks started first"
    finally:
        forget(store, [r.id for r in (*normal, *urgent)])
        app.close()


@pytest.mark.timeout(60)
def test_delivery_counts_quorum_and_classic(node, store):
    """A quorum queue counts deliveries itself (x-delivery-count); a classic one is counted in the
    store by task id. A message redelivered past max_attempts is dead-lettered with the reason."""
    for quorum in (True, False):
        queue = new_queue("quorum" if quorum else "classic")
        params = (
            {"queue_type": "quorum", "delivery_limit": 5} if quorum else {"delivery_store": RESULTS_REDIS}
        )
        url = amqp_url(node.port, queue, **params)
        producer = open_producer(url)  # declares the queue as the URL says
        app = celery_app(node.url, [task_queue(queue, quorum=quorum, delivery_limit=5 if quorum else None)])
        sent = app.send_task(TASK, kwargs=job(2), queue=queue)  # Celery agrees with the declaration
        source = open_source(url, consumer="c")
        counts = []
        for _ in range(3):
            (lease,) = source.lease(1, 5.0)
            counts.append(lease.delivery_count)
            source.release([lease])
        (lease,) = source.lease(1, 5.0)
        source.dead_letter(lease, f"delivered {lease.delivery_count} times")
        source.close()
        producer.close()
        assert counts == [1, 2, 3], (quorum, counts)
        (letter,) = open_dead_letters(url).read()
        assert letter.id == sent.id and letter.reason == "delivered 4 times" and letter.attempts == 4
        assert open_dead_letters(url).purge() == 1
        app.close()
    forget(store, [sent.id])
    # Past x-delivery-limit (2: three deliveries) the broker dead-letters a quorum queue's message itself.
    url = amqp_url(node.port, new_queue("limit"), queue_type="quorum", delivery_limit=2)
    producer = open_producer(url)
    producer.send([OutgoingJob("poison", json.dumps(job(2)).encode())])
    source = open_source(url, consumer="c")
    assert source.max_deliveries == 3
    counts = []
    while leases := source.lease(1, 1.0):
        counts.append(leases[0].delivery_count)
        source.release(leases)
    source.close()
    producer.close()
    assert counts == [1, 2, 3]
    (letter,) = open_dead_letters(url).read()
    assert letter.id == "poison" and "delivery_limit" in letter.reason


@pytest.mark.timeout(30)
def test_a_queue_declared_otherwise_is_named_not_retried(node):
    queue = new_queue("mismatch")
    open_producer(amqp_url(node.port, queue, max_priority=10)).close()
    with pytest.raises(AmqpQueueMismatch, match="other arguments"):
        open_source(amqp_url(node.port, queue), consumer="c")
    # declare=false only checks that it exists (here a plain queue, as Celery creates one without
    # task_queues); qworker's dead-letter exchange and queue are still declared.
    import amqp

    queue = new_queue("plain")
    connection = amqp.Connection(f"127.0.0.1:{node.port}")
    connection.connect()
    channel = connection.channel()
    channel.exchange_declare(queue, "direct", durable=True, auto_delete=False)
    channel.queue_declare(queue, durable=True, auto_delete=False)
    channel.queue_bind(queue, queue, routing_key=queue)
    connection.close()
    url = amqp_url(node.port, queue, declare="false")
    source = open_source(url, consumer="c")
    props = {"content_type": "application/x-python-serialize", "application_headers": celery_headers("p1")}
    publish_raw(node.port, queue, [(b"\x80\x04N.", props)])
    (lease,) = source.lease(1, 5.0)
    assert lease.rejection is not None and lease.body == b""
    source.dead_letter(lease, lease.rejection)
    source.close()
    assert [d.id for d in open_dead_letters(url).read()] == ["p1"] and queue_counts(node.port, queue) == 0


@pytest.mark.timeout(90)
def test_hostile_raw_messages_each_get_one_outcome(node, store, engine):
    """Raw AMQP messages a hostile producer could send: each ends with exactly one outcome (a
    failed result, or a dead letter and a failed result), good jobs between them complete, and the
    queue ends empty."""
    queue = new_queue("poison")
    url = amqp_url(node.port, queue)
    open_producer(url).close()
    json_props = {"content_type": "application/json", "content_encoding": "utf-8", "delivery_mode": 2}
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    cases: dict[str, tuple[bytes, dict]] = {
        "invalid-utf8": (b'[[], {"prompt": "\xff\xfe"}, {}]', json_props),
        "invalid-utf8-raw": (b"\xc3\x28\xa0\xa1", json_props),
        "not-json": (b"this is not json", json_props),
        "json-not-a-list": (b'{"prompt": "hi"}', json_props),
        "huge": (json.dumps([[], {"prompt": "x" * 3_000_000}, embed]).encode(), json_props),
        "huge-token-ids": (
            json.dumps([[], {"prompt_token_ids": list(range(200_000))}, embed]).encode(),
            json_props,
        ),
        "text-plain": (b"hello", {**json_props, "content_type": "text/plain"}),
        "yaml": (b"prompt: hi", {**json_props, "content_type": "application/x-yaml"}),
        "msgpack": (b"\x81\xa6prompt\xa2hi", {**json_props, "content_type": "application/x-msgpack"}),
        "no-content-type": (b'[[], {"prompt": "hi"}, {}]', {"delivery_mode": 2}),
        "latin1": (b'[[], {"prompt": "hi"}, {}]', {**json_props, "content_encoding": "latin-1"}),
        "compressed": (b"x\x9c", json_props),
        "wrong-task": (b'[[], {"prompt": "hi"}, {}]', json_props),
        "bad-params": (
            json.dumps([[], {"prompt": "hi", "params": {"temperature": "hot"}}, embed]).encode(),
            json_props,
        ),
        "positional": (json.dumps([["a", "b"], {}, embed]).encode(), json_props),
    }
    messages, ids = [], {}
    for i, (kind, (body, properties)) in enumerate(cases.items()):
        task_id = f"{queue}-{kind}"
        headers = celery_headers(task_id, task="other.task" if kind == "wrong-task" else TASK)
        if kind == "compressed":
            headers["compression"] = "application/x-gzip"
        messages.append((body, {**properties, "application_headers": headers}))
        ids[task_id] = kind
        good_id = f"{queue}-good-{i}"
        good = json.dumps([[], job(2, first=30 + i), embed]).encode()
        messages.append((good, {**json_props, "application_headers": celery_headers(good_id)}))
        ids[good_id] = "good"
    publish_raw(node.port, queue, messages)
    sink = open_sink(RESULTS)
    try:
        stats = make_worker(engine, url).run(burst=True)
        outcomes = {}
        for task_id, kind in ids.items():
            result = sink.get_result(task_id)
            assert result is not None, f"{kind}: no outcome"
            outcomes[kind] = result.status.value
        assert all(outcomes[k] == "failed" for k in cases), outcomes
        assert sum(
            1 for k, v in ids.items() if v == "good" and sink.get_result(k).status.value == "completed"
        ) == len(cases)
        letters = {d.id: d.reason for d in open_dead_letters(url).read()}
        refused = {"text-plain", "yaml", "msgpack", "no-content-type", "latin1", "compressed", "wrong-task"}
        assert {ids[i] for i in letters} >= refused, letters
        assert stats.num_dead_lettered == len(letters) and stats.num_completed == len(cases)
        assert queue_counts(node.port, queue) == 0
    finally:
        forget(store, ids)


@pytest.mark.timeout(60)
def test_backlog_counts_ready_messages_at_the_mean_job_size(node):
    queue = new_queue("backlog")
    url = amqp_url(node.port, queue)
    producer = open_producer(url)
    producer.send([OutgoingJob(f"{queue}-{i}", json.dumps(job(2)).encode()) for i in range(7)])
    sizing = PoolSizing()
    backlog = open_backlog(url, sizing)
    work = backlog.read(None)
    assert work.waiting.num_jobs == 7 and work.waiting.num_blocks == 7 * sizing.mean_job_blocks
    assert work.in_flight.num_jobs == 0
    assert producer.queue_depth() == 7
    backlog.close()
    # The exporter's reading: KV demand = depth x the configured mean blocks per job.
    reader = open_pool_demand_reader(url, sizing)
    demand = reader.read()
    assert demand.waiting.num_jobs == 7 and demand.demand_blocks == 7 * sizing.mean_job_blocks
    assert demand.desired_workers >= 1
    reader.close()
    producer.close()


@pytest.mark.timeout(60)
def test_amqps_with_kombu_tls_options(node, store, engine):
    """qworker over TLS (the node's own self-signed CA), a Celery app over plain AMQP."""
    queue = new_queue("tls")
    app = celery_app(node.url, [task_queue(queue)])
    ca = node.tls_files["ca"]
    url = f"celery+amqps://guest:guest@localhost:{node.tls_port}/?queue={queue}&ssl_ca_certs={ca}&ssl_cert_reqs=required"
    sent = [app.send_task(TASK, kwargs=job(2, first=40 + i), queue=queue) for i in range(3)]
    try:
        assert make_worker(engine, url).run(burst=True).num_completed == 3
        assert all(r.get(timeout=10)["status"] == "completed" for r in sent)
        # A certificate nobody vouches for is refused.
        other = url.replace(str(ca), str(node.tls_files["cert"]))
        with pytest.raises(ConnectionError):
            open_source(other.replace("ssl_cert_reqs=required", "ssl_cert_reqs=required"), consumer="c")
    finally:
        forget(store, [r.id for r in sent])
        app.close()
