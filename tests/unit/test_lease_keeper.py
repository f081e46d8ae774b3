"""A step longer than the lease: the keeper extends the held leases while the step runs, so that
no peer takes the job mid-step and no further delivery counts towards its dead-letter limit.
The tests wait on events (an extension made, the keeper thread's next look at its clock), never
on a sleep that a loaded machine could outlast: where a lease must lapse, the queue's clock is a
fake one that the test moves."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

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


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class FakeClock:
    """The memory queue's clock: leases lapse only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_step_four_leases_long_keeps_its_job_from_a_peer():
    clock = FakeClock()
    queue = MemoryQueue("jobs", clock=clock)
    queue.put(json.dumps({"prompt": "hello", "params": {"max_tokens": 4}}).encode(), "a")
    worker, sink, engine = slow_worker(queue)
    peer = MemorySource(queue, consumer="peer", lease_timeout_s=LEASE_S)
    keeper = worker._lease_keeper
    taken: list[Lease] = []

    def long_step(step: int) -> None:
        if step != 2:
            return
        # Five times 0.9 of a lease on the queue's clock (4.5 leases in all), each move followed
        # by an extension from the keeper: without the keeper the lease taken before the step
        # lapses at the second move, and the peer takes the job.
        for _ in range(5):
            clock.now += 0.9 * LEASE_S
            num_extensions = keeper.num_extensions
            wait_until(lambda n=num_extensions: keeper.num_extensions > n, "an extension during the step")
            taken.extend(peer.lease(1, 0.0))

    engine.on_step = long_step
    stats = worker.run(burst=True)
    assert taken == []
    assert stats.num_leases_lost == 0
    result = sink.get_result("a")
    assert result is not None and result.status is JobStatus.COMPLETED and result.attempts == 1
    assert keeper.num_extensions >= 5


def test_a_lease_lost_during_a_step_drops_the_job_before_its_outputs():
    """The peer took the job while the broker was away for the keeper: found at the next
    extension in the step, the job leaves the engine and gets no result here."""
    queue = MemoryQueue("jobs")
    queue.put(json.dumps({"prompt": "hello", "params": {"max_tokens": 40}}).encode(), "a")
    worker, sink, engine = slow_worker(queue)
    peer = MemorySource(queue, consumer="peer", lease_timeout_s=30.0)
    keeper = worker._lease_keeper
    taken: list[Lease] = []

    def steal(step: int) -> None:
        if step == 2:
            queue.expire()
            taken.extend(peer.lease(1, 0.0))
            # The step lasts until the keeper's next extension (which finds the lease gone).
            num_extensions = keeper.num_extensions
            wait_until(lambda n=num_extensions: keeper.num_extensions > n, "an extension during the step")

    # The steps the worker had counted when it aborted the job: 1 when the abort came before
    # step 2's outputs (the keeper's finding), 2 or more when the loop found the loss later.
    steps_at_abort: list[int] = []
    abort = engine.abort

    def counting_abort(request_id: str):
        steps_at_abort.append(worker.stats.num_steps)
        return abort(request_id)

    engine.abort = counting_abort  # type: ignore[method-assign]
    engine.on_step = steal
    stats = worker.run(burst=True)
    assert [le.job_id for le in taken] == ["a"]
    assert stats.num_leases_lost == 1
    assert engine.aborted == ["a"] and steps_at_abort == [1]
    assert sink.get_result("a") is None


class KeeperClock:
    """Stands in for the lease keeper module's `time`: time.monotonic() is a fake clock, and
    `looks` counts the keeper thread's readings of it (one a poll), so that a test can wait for
    the keeper's next polls instead of sleeping past them."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.looks = 0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            if threading.current_thread().name == "qworker-lease-keeper":
                self.looks += 1
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def wait_for_polls(self, num_polls: int) -> None:
        """Returns once the keeper began `num_polls` polls after this call; every poll but the
        last one has then run to its end."""
        with self._lock:
            target = self.looks + num_polls
        wait_until(lambda: self.looks >= target, f"{num_polls} polls of the keeper")


@pytest.fixture
def keeper_clock(monkeypatch) -> KeeperClock:
    from qworker.worker import lease_keeper

    clock = KeeperClock()
    monkeypatch.setattr(lease_keeper, "time", SimpleNamespace(monotonic=clock.monotonic))
    return clock


def test_an_extension_that_fails_is_left_to_the_loop():
    attempts = threading.Semaphore(0)

    class FailingSource(MemorySource):
        def extend(self, leases: list[Lease]) -> list[Lease]:
            attempts.release()
            raise ConnectionError("broker away")

    queue = MemoryQueue("jobs")
    source = FailingSource(queue, consumer="w1", lease_timeout_s=LEASE_S)
    keeper = StepLeaseKeeper(source, lambda: [ONE_LEASE], interval_s=0.1)
    keeper.start()
    try:
        keeper.step_started()
        # Two attempts: the keeper thread lived through the first failure and tried again.
        assert attempts.acquire(timeout=10) and attempts.acquire(timeout=10), "the keeper kept trying"
        assert keeper.step_ended() == []
        assert keeper.num_extensions == 0
    finally:
        keeper.stop()


def test_no_extension_outside_a_step(keeper_clock):
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
        # Past the interval, and two polls later (so one poll ran to its end): no step, no call.
        keeper_clock.advance(1.0)
        keeper_clock.wait_for_polls(2)
        assert calls == []
        keeper.step_started()
        keeper_clock.advance(1.0)
        wait_until(lambda: bool(calls), "an extension during the step")
        keeper.step_ended()
        assert calls and all(n == 1 for n in calls)
        seen = len(calls)
        keeper_clock.advance(1.0)
        keeper_clock.wait_for_polls(2)
        assert len(calls) == seen
    finally:
        keeper.stop()
