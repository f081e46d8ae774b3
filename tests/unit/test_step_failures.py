"""A failure inside a step, or while taking one message, never takes the worker down; attempts are
visible to stream readers. On the in-memory source and sink and the scripted fake engine: no
model, no Redis.

The fake engine emits "abcdef..." one token per step. `engine.failing_steps[n]` makes step n raise
EngineStepError naming the given requests (None: every running one); `engine.on_step(n)` runs at
the start of step n.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from qworker.backends.memory.queue import Journal, MemoryQueue, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.backends.sink import Delta, ResumePoint
from qworker.errors import EngineFailedError, StreamRestartedError
from qworker.jobs.client import Client
from qworker.jobs.job import JobResult, JobStatus
from qworker.testing.fake_engine import FakeEngine
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings

pytestmark = pytest.mark.timeout(30)


class Harness:
    def __init__(
        self, engine: FakeEngine | None = None, queue: MemoryQueue | None = None, name: str = "w1", **settings
    ) -> None:
        self.journal: Journal = []
        self.queue = queue or MemoryQueue("jobs")
        self.source = MemorySource(self.queue, consumer=name, journal=self.journal)
        self.sink = MemoryResultSink(self.journal)
        self.engine = engine or FakeEngine()
        defaults: dict[str, Any] = dict(
            name=name, max_backlog=4, poll_interval_s=0.01, cancel_check_interval_s=0.0
        )
        self.worker = Worker(self.engine, self.source, self.sink, WorkerSettings(**{**defaults, **settings}))

    def put(self, job_id: str | None, body: dict[str, Any] | bytes) -> str:
        return self.queue.put(body if isinstance(body, bytes) else json.dumps(body).encode(), job_id)

    def result(self, job_id: str) -> JobResult:
        result = self.sink.get_result(job_id)
        assert result is not None, f"no result for {job_id}; journal {self.journal}"
        return result

    def assert_engine_empty(self) -> None:
        kv = self.engine.kv_stats()
        assert not self.engine.has_unfinished_requests()
        assert kv.num_free_blocks == kv.num_total_blocks, kv


def job(max_tokens: int = 5, **fields: Any) -> dict[str, Any]:
    fields.setdefault("prompt", "hello")
    return {"params": {"max_tokens": max_tokens, "temperature": 0.0}, **fields}


# -- a failed step -----------------------------------------------------------------------------


def test_a_failed_step_fails_its_jobs_and_the_worker_carries_on():
    h = Harness()
    h.put("bad", job(10))
    h.put("good", job(6))
    h.engine.failing_steps = {3: ["bad"]}
    stats = h.worker.run(burst=True)
    bad = h.result("bad")
    assert (bad.status, bad.error.type) == (JobStatus.FAILED, "InternalError")
    assert "scripted failure of step 3" in bad.error.message
    # Its partial output (two steps before the failure) is kept, as for a timeout.
    assert (bad.text, bad.finish_reason) == ("ab", "failed")
    assert h.engine.aborted == ["bad"]
    assert h.result("good").text == "abcdef"
    assert (stats.num_failed, stats.num_completed, h.queue.depth()) == (1, 1, 0)
    h.assert_engine_empty()
    # Jobs taken after the failure run normally.
    h.put("later", job(3))
    assert h.worker.run(burst=True).num_completed == 2
    assert h.result("later").text == "abc"


def test_a_step_that_cannot_say_which_jobs_fails_every_job_in_the_engine():
    h = Harness()
    h.put("a", job(10))
    h.put("b", job(10))

    def broken(step: int) -> None:
        if step == 2:
            raise RuntimeError("CUDA error: an illegal memory access")

    h.engine.on_step = broken
    stats = h.worker.run(burst=True)
    for job_id in ("a", "b"):
        result = h.result(job_id)
        assert (result.status, result.error.type) == (JobStatus.FAILED, "InternalError")
        assert "RuntimeError: CUDA error: an illegal memory access" in result.error.message
    assert sorted(h.engine.aborted) == ["a", "b"]
    assert (stats.num_failed, h.queue.depth()) == (2, 0)
    h.assert_engine_empty()


def test_failures_that_are_not_in_a_row_do_not_stop_the_worker():
    h = Harness(max_step_failures=2)
    for i in range(4):
        h.put(f"j{i}", job(4))
    # Failing steps 2 and 4 with a good step between: never two in a row.
    h.engine.failing_steps = {2: ["j0"], 4: ["j1"]}
    stats = h.worker.run(burst=True)
    assert (stats.num_failed, stats.num_completed) == (2, 2)
    h.assert_engine_empty()


def test_failures_in_a_row_hand_the_jobs_back_and_stop_the_worker():
    h = Harness(max_step_failures=3)
    for job_id in ("a", "b", "c"):
        h.put(job_id, job(20))
    # Step 2 names "a" (failed at once); steps 3 and 4 name nobody: the engine is broken.
    h.engine.failing_steps = {2: ["a"], 3: [], 4: []}
    with pytest.raises(EngineFailedError, match="failed 3 steps in a row") as info:
        h.worker.run(burst=True)
    assert info.value.num_failures == 3
    assert h.result("a").error.type == "InternalError"
    # The others were not at fault: back in the queue for a peer, with the reason noted.
    assert h.sink.results.keys() == {"a"}
    assert h.queue.num_ready == 2
    assert [e for e, subject in h.journal if subject == "b"][-1] == "release"
    assert "its engine failed 3 steps in a row" in h.sink.last_error("b")
    h.assert_engine_empty()
    # The next worker is told why when the job runs out of attempts.
    peer = Harness(queue=h.queue, name="w2", max_attempts=1)
    peer.sink = h.sink
    peer.worker.sink = h.sink
    peer.worker.run(burst=True)
    result = h.result("b")
    assert result.error.type == "DeadLettered"
    assert "last error: worker w1 stopped: its engine failed 3 steps in a row" in result.error.message
    assert {dead.job_id for dead in h.queue.dead_letters} == {"b", "c"}


def test_max_step_failures_must_be_positive():
    with pytest.raises(ValueError, match="max_step_failures"):
        WorkerSettings(max_step_failures=0)


# -- one bad message in a batch ----------------------------------------------------------------


class FlakySink(MemoryResultSink):
    """A store whose lookup fails for one job id, as an unforeseen bug would."""

    def has_result(self, job_id: str) -> bool:
        if job_id == "boom":
            raise KeyError("unforeseen")
        return super().has_result(job_id)


def test_an_unforeseen_error_while_taking_a_message_is_confined_to_it():
    h = Harness()
    h.sink = FlakySink(h.journal)
    h.worker.sink = h.sink
    h.put("first", job(3))
    h.put("boom", job(3))
    h.put("last", job(3))
    stats = h.worker.run(burst=True)
    result = h.result("boom")
    assert (result.status, result.error.type) == (JobStatus.FAILED, "InternalError")
    assert "KeyError" in result.error.message
    [dead] = h.queue.dead_letters
    assert dead.job_id == "boom" and "internal error while taking the job" in dead.reason
    assert h.result("first").text == h.result("last").text == "abc"
    assert (stats.num_completed, stats.num_dead_lettered, h.queue.depth()) == (2, 1, 0)


def test_a_worker_that_died_is_named_in_the_dead_letter_reason():
    h = Harness()
    h.put("poison", job(50))

    class Died(BaseException):
        """Stands for SIGKILL: nothing in the loop runs after it."""

    def die(step: int) -> None:
        if step == 3:
            raise Died

    h.engine.on_step = die
    with pytest.raises(Died):
        h.worker.run(burst=True)
    h.queue.expire()
    peer = Harness(queue=h.queue, name="w2", max_attempts=1)
    peer.sink = h.sink
    peer.worker.sink = h.sink
    peer.worker.run(burst=True)
    result = h.result("poison")
    assert result.error.type == "DeadLettered"
    assert "delivered 2 times; max_attempts is 1; last error: attempt 1 (worker w1" in result.error.message
    assert "ended without a result" in result.error.message
    [dead] = h.queue.dead_letters
    assert dead.reason == result.error.message


# -- attempts seen by stream readers -----------------------------------------------------------


def test_a_rerun_opens_its_deltas_with_an_attempt_marker():
    h = Harness(drain_grace_s=0.0)
    h.put("a", job(8))
    h.engine.on_step = lambda step: h.worker.stop() if step == 4 else None
    assert h.worker.run().num_released == 1
    peer = Harness(queue=h.queue, name="w2")
    peer.sink = h.sink
    peer.worker.sink = h.sink
    peer.worker.run(burst=True)
    deltas = h.sink.deltas["a"]
    markers = [i for i, d in enumerate(deltas) if d.attempt is not None]
    assert [deltas[i].attempt for i in markers] == [2]
    assert "".join(d.text for d in deltas[: markers[0]]) == "abcd"
    # The rerun resumes from the 4 tokens its delta stream holds (docs/queues.md "Resume from
    # tokens"): its marker keeps them, and it streams only the rest.
    assert deltas[markers[0]].resume == ResumePoint(4, 4)
    assert "".join(d.text for d in deltas[markers[0] :]) == "efgh"
    assert h.result("a").text == "abcdefgh"
    # A reader that starts now sees the kept text and the rest.
    assert "".join(d.text for d in h.sink.read_deltas("a", timeout_s=1)) == "abcdefgh"


def memory_client() -> tuple[Client, MemoryResultSink]:
    name = f"stream-{uuid.uuid4().hex[:8]}"
    client = Client(queue=f"memory://{name}", results=f"memory://{name}")
    assert isinstance(client.sink, MemoryResultSink)
    return client, client.sink


def write(sink: MemoryResultSink, job_id: str, *items: str | int) -> None:
    """Text deltas (str) and attempt markers (int)."""
    sink.write_deltas(
        [Delta(job_id, "", attempt=item) if isinstance(item, int) else Delta(job_id, item) for item in items]
    )


def test_client_stream_does_not_repeat_a_rerun_that_draws_the_same_text():
    client, sink = memory_client()
    stream = client.stream("j", timeout=5)
    write(sink, "j", "Hel", "lo")
    assert [next(stream), next(stream)] == ["Hel", "lo"]
    # The worker died; the rerun streams from the start and catches up silently.
    write(sink, "j", 2, "He", "l", "lo wo", "rld")
    sink.write_result(JobResult(id="j", status=JobStatus.COMPLETED, text="Hello world"))
    assert list(stream) == [" wo", "rld"]
    # Restarted twice, read from the start: only the latest attempt.
    assert "".join(client.stream("j", timeout=5)) == "Hello world"


def test_client_stream_raises_when_a_rerun_draws_other_text():
    client, sink = memory_client()
    stream = client.stream("j", timeout=5)
    write(sink, "j", "Hello")
    assert next(stream) == "Hello"  # a reader that saw the first attempt
    write(sink, "j", 2, "Help")
    with pytest.raises(StreamRestartedError, match="attempt 2"):
        next(stream)
    sink.write_result(JobResult(id="j", status=JobStatus.COMPLETED, text="Help!"))
    write(sink, "j", "!")
    # Streamed again from the start: the latest attempt only, equal to the result.
    assert "".join(client.stream("j", timeout=5)) == "Help!"


def test_client_stream_raises_when_a_rerun_ends_shorter():
    client, sink = memory_client()
    stream = client.stream("j", timeout=5)
    write(sink, "j", "Hello")
    assert next(stream) == "Hello"
    write(sink, "j", 2, "Hel")
    sink.write_result(JobResult(id="j", status=JobStatus.CANCELLED, text="Hel"))
    with pytest.raises(StreamRestartedError):
        list(stream)
