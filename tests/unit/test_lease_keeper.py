"""A step longer than the lease: the keeper extends the held leases while the step runs, so that
no peer takes the job mid-step and no further delivery counts towards its dead-letter limit.
The in-memory queue's leases run on the real clock; the fake engine's step is made slow."""

from __future__ import annotations

import json
import time

import pytest

from qworker.backends.memory.queue import MemoryQueue, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.backends.source import Lease
from qworker.jobs.job import JobStatus
from qworker.testing.fake_engine import FakeEngine
from qworker.worker.lease_keeper import StepLeaseKeeper
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(30)

LEASE_S = 0.6
ONE_LEASE = Lease(message_id="1", body=b"{}", job_id="a", delivery_count=1, enqueued_at=None)


def slow_worker(queue: MemoryQueue) -> tuple[Worker, MemoryResultSink, FakeEngine]:
    source = MemorySource(queue, consumer="w1", lease_timeout_s=LEASE_S)
    sink = MemoryResultSink([])
    engine = FakeEngine()
    settings = WorkerSettings(name="w1", poll_interval_s=0.01, cancel_check_interval_s=0.0)
    return Worker(engine, source, sink, settings), sink, engine


def test_a_step_four_leases_long_keeps_its_job_from_a_peer():
    queue = MemoryQueue("jobs")
    queue.put(json.dumps({"prompt": "hello", "params": {"max_tokens": 4}}).encode(), "a")
    worker, sink, engine = slow_worker(queue)
    peer = MemorySource(queue, consumer="peer", lease_timeout_s=LEASE_S)
    taken: list[Lease] = []

    def long_step(step: int) -> None:
        if step == 2:
            deadline = time.monotonic() + 4 * LEASE_S
            while time.monotonic() < deadline:
                taken.extend(peer.lease(1, 0.0))
                time.sleep(0.05)

    engine.on_step = long_step
    stats = worker.run(burst=True)
    assert taken == []
    assert stats.num_leases_lost == 0
    result = sink.get_result("a")
    assert result is not None and result.status is JobStatus.COMPLETED and result.attempts == 1
    assert worker._lease_keeper.num_extensions >= 3


def test_a_lease_lost_during_a_step_drops_the_job_before_its_outputs():
    """The peer took the job while the broker was away for the keeper: found at the next
    extension in the step, the job leaves the engine and gets no result here."""
    queue = MemoryQueue("jobs")
    queue.put(json.dumps({"prompt": "hello", "params": {"max_tokens": 40}}).encode(), "a")
    worker, sink, engine = slow_worker(queue)
    peer = MemorySource(queue, consumer="peer", lease_timeout_s=30.0)
    taken: list[Lease] = []

    def steal(step: int) -> None:
        if step == 2:
            queue.expire()
            taken.extend(peer.lease(1, 0.0))
            time.sleep(2 * LEASE_S)

    engine.on_step = steal
    stats = worker.run(burst=True)
    assert [le.job_id for le in taken] == ["a"]
    assert stats.num_leases_lost == 1
    assert engine.aborted == ["a"]
    assert sink.get_result("a") is None


class FailingSource(MemorySource):
    def extend(self, leases: list[Lease]) -> list[Lease]:
        raise ConnectionError("broker away")


def test_an_extension_that_fails_is_left_to_the_loop():
    queue = MemoryQueue("jobs")
    source = FailingSource(queue, consumer="w1", lease_timeout_s=LEASE_S)
    keeper = StepLeaseKeeper(source, lambda: [ONE_LEASE], interval_s=0.1)
    keeper.start()
    try:
        keeper.step_started()
        time.sleep(0.5)
        assert keeper.step_ended() == []
        assert keeper.num_extensions == 0
    finally:
        keeper.stop()


def test_no_extension_outside_a_step():
    queue = MemoryQueue("jobs")
    calls: list[int] = []

    class CountingSource(MemorySource):
        def extend(self, leases: list[Lease]) -> list[Lease]:
            calls.append(len(leases))
            return []

    source = CountingSource(queue, consumer="w1", lease_timeout_s=LEASE_S)
    keeper = StepLeaseKeeper(source, lambda: [ONE_LEASE], interval_s=0.1)
    keeper.start()
    try:
        time.sleep(0.4)
        assert calls == []
        keeper.step_started()
        time.sleep(0.4)
        keeper.step_ended()
        assert calls and all(n == 1 for n in calls)
        seen = len(calls)
        time.sleep(0.4)
        assert len(calls) == seen
    finally:
        keeper.stop()
