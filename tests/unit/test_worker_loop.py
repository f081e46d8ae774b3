"""The worker loop's paths, on the in-memory source and sink and the scripted fake engine: no
model, no Redis. Each test runs the loop in burst mode (process what is there, then return).

The fake engine emits "abcdef..." one token per step; `engine.on_step(n)` runs at the start of
step n, which is where a test acts mid-run. The shared journal records ("deltas" | "result" |
"ack" | "release" | "dead_letter", job id) in order.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from qworker.backends.memory.queue import Journal, MemoryQueue, MemorySource
from qworker.backends.memory.results import MemoryResultSink
from qworker.backends.source import Lease
from qworker.config import EngineConfig
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidRequestError, PromptTooLongError
from qworker.jobs.job import Job, JobResult, JobStatus
from qworker.testing.fake_engine import FakeEngine
from qworker.worker import intake
from qworker.worker.held import HeldJob, HeldJobs, leases_of
from qworker.worker.loop import Worker
from qworker.worker.settings import WorkerSettings
from qworker.worker.stats import RESULT_COUNTERS, WorkerStats

pytestmark = pytest.mark.timeout(30)


@dataclass
class Harness:
    queue: MemoryQueue
    source: MemorySource
    sink: MemoryResultSink
    engine: FakeEngine
    worker: Worker
    journal: Journal = field(default_factory=list)

    def put(self, job_id: str | None, body: dict[str, Any] | bytes, **put_args: Any) -> str:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.queue.put(raw, job_id, **put_args)

    def result(self, job_id: str) -> JobResult:
        result = self.sink.get_result(job_id)
        assert result is not None, f"no result for {job_id}; journal {self.journal}"
        return result

    def events(self, job_id: str) -> list[str]:
        return [event for event, subject in self.journal if subject == job_id]


def make_harness(
    engine: FakeEngine | None = None,
    queue: MemoryQueue | None = None,
    name: str = "w1",
    max_deliveries: int | None = None,
    **settings: Any,
) -> Harness:
    journal: Journal = []
    queue = queue or MemoryQueue("jobs")
    source = MemorySource(queue, consumer=name, max_deliveries=max_deliveries, journal=journal)
    sink = MemoryResultSink(journal)
    engine = engine or FakeEngine()
    defaults: dict[str, Any] = dict(
        name=name, max_backlog=4, poll_interval_s=0.01, cancel_check_interval_s=0.0
    )
    worker = Worker(engine, source, sink, WorkerSettings(**{**defaults, **settings}))
    return Harness(queue, source, sink, engine, worker, journal)


def job(max_tokens: int = 5, **fields: Any) -> dict[str, Any]:
    if not {"prompt", "messages", "prompt_token_ids"} & set(fields):
        fields["prompt"] = "hello"
    return {"params": {"max_tokens": max_tokens, "temperature": 0.0}, **fields}


# -- the normal path ---------------------------------------------------------------------------


def test_jobs_complete_with_deltas_then_result_then_ack():
    h = make_harness()
    h.put("text", job(5, prompt="hello", metadata={"k": "v"}))
    h.put("chat", job(7, messages=[{"role": "user", "content": "hi"}]))
    h.put("ids", job(3, prompt_token_ids=[1, 2, 3, 4]))
    stats = h.worker.run(burst=True)

    assert stats.num_completed == 3
    assert h.queue.depth() == 0
    assert not h.engine.has_unfinished_requests()
    text = h.result("text")
    assert (text.status, text.text, text.finish_reason) == (JobStatus.COMPLETED, "abcde", "length")
    assert text.token_ids == list(b"abcde")
    assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (5, 5)
    assert (text.metadata, text.attempts, text.worker) == ({"k": "v"}, 1, "w1")
    assert text.timings.enqueued_at <= text.timings.started_at <= text.timings.first_token_at
    assert h.result("chat").text == "abcdefg"
    assert h.result("ids").usage.prompt_tokens == 4
    for job_id, num_tokens in (("text", 5), ("chat", 7), ("ids", 3)):
        # Every delta before the result, the result before the ack: at-least-once, one result.
        assert h.events(job_id) == ["deltas"] * num_tokens + ["result", "ack"]
        streamed = "".join(d.text for d in h.sink.read_deltas(job_id, timeout_s=1))
        assert streamed == h.result(job_id).text


def test_script_end_is_a_stop():
    engine = FakeEngine(script=lambda request_id, prompt_token_ids: list(b"ok"))
    h = make_harness(engine)
    h.put("a", job(10))
    h.worker.run(burst=True)
    assert (h.result("a").text, h.result("a").finish_reason) == ("ok", "stop")


def test_admission_keeps_the_backlog_small_and_the_rest_queued():
    # 16 blocks of 4 tokens; a 9-token prompt takes 3 blocks, so about four jobs run at once.
    engine = FakeEngine(EngineConfig(model="fake", block_size=4, num_kv_blocks=16, max_num_seqs=8))
    h = make_harness(engine, max_backlog=2)
    for i in range(12):
        h.put(f"j{i}", job(8, prompt_token_ids=list(range(1, 10))))
    seen = []

    def check(step: int) -> None:
        admission = h.worker.admission_stats()
        seen.append((admission.num_jobs_held, engine.num_running, h.queue.num_ready))
        assert admission.num_jobs_not_started <= 2, admission
        # At most five 3-block prompts fit in 16 blocks, plus the backlog of two.
        assert admission.num_jobs_held <= 5 + 2, admission

    engine.on_step = check
    stats = h.worker.run(burst=True)
    assert stats.num_completed == 12
    assert [h.result(f"j{i}").text for i in range(12)] == ["abcdefgh"] * 12
    # Jobs waited in the queue, not in the worker, while the cache was full.
    assert max(num_ready for _, _, num_ready in seen) > 0
    assert max(num_running for _, num_running, _ in seen) > 1


# -- exits before the engine -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "error_type", "message"),
    [
        (b"{not json", "InvalidJSON", "not valid JSON"),
        (json.dumps(job(bogus=1)).encode(), "ValidationError", "bogus: unknown field"),
        (json.dumps(job(0)).encode(), "ValidationError", "max_tokens"),
        (json.dumps({"params": {}}).encode(), "ValidationError", "exactly one of"),
        (json.dumps(job(prompt_token_ids=[1, 999])).encode(), "InvalidRequestError", "vocabulary"),
        (json.dumps(job(prompt_token_ids=list(range(1, 250)) * 2)).encode(), "PromptTooLongError", "context"),
    ],
)
def test_bad_input_gets_a_failed_result_and_is_acked(body, error_type, message):
    h = make_harness()
    h.put("bad", body)
    h.put("good", job(2))
    stats = h.worker.run(burst=True)
    result = h.result("bad")
    assert result.status is JobStatus.FAILED
    assert result.error is not None
    assert result.error.type == error_type
    assert message in result.error.message
    # A prompt too long here may fit a worker with a longer context: it is kept to replay.
    assert h.events("bad") == ["result", "dead_letter" if error_type == "PromptTooLongError" else "ack"]
    assert h.engine.added == ["good"]
    # Bad input never blocks the queue.
    assert h.result("good").status is JobStatus.COMPLETED
    is_kept = error_type == "PromptTooLongError"
    assert (stats.num_failed, stats.num_dead_lettered) == ((0, 1) if is_kept else (1, 0))
    assert (stats.num_completed, h.queue.depth()) == (1, 0)


def test_text_prompt_without_a_tokenizer_fails():
    h = make_harness(FakeEngine(has_tokenizer=False))
    h.put("a", job(2, prompt="hi"))
    h.put("b", job(2, prompt_token_ids=[5, 6]))
    h.worker.run(burst=True)
    assert "no tokenizer" in h.result("a").error.message
    assert h.result("b").status is JobStatus.COMPLETED


def test_message_without_a_readable_id_is_dead_lettered():
    h = make_harness()
    message_id = h.put(None, b"\xff\xfe not a job")
    stats = h.worker.run(burst=True)
    assert stats.num_dead_lettered == 1
    [dead] = h.queue.dead_letters
    assert (dead.message_id, dead.body) == (message_id, b"\xff\xfe not a job")
    assert "cannot read a job id" in dead.reason
    assert h.sink.results == {}
    assert h.queue.depth() == 0


def test_job_without_id_gets_a_stable_derived_one():
    h = make_harness()
    h.put(None, job(2))
    h.worker.run(burst=True)
    [result] = h.sink.results.values()
    assert result.status is JobStatus.COMPLETED
    assert h.engine.added == [result.id]


def test_expired_ttl_fails_without_running():
    h = make_harness()
    h.put("old", job(2, ttl_s=5), enqueued_at=time.time() - 60)
    h.put("fresh", job(2, ttl_s=5))
    h.worker.run(burst=True)
    result = h.result("old")
    assert (result.status, result.error.type) == (JobStatus.FAILED, "Expired")
    assert "ttl_s is 5" in result.error.message
    assert h.engine.added == ["fresh"]
    assert h.events("old") == ["result", "ack"]


def test_cancelled_before_start_is_not_run():
    h = make_harness()
    h.put("a", job(2))
    h.sink.request_cancel("a")
    stats = h.worker.run(burst=True)
    assert h.result("a").status is JobStatus.CANCELLED
    assert h.engine.added == []
    assert (stats.num_cancelled, h.events("a")) == (1, ["result", "ack"])


def test_redelivered_job_with_a_result_is_acked_without_running():
    h = make_harness()
    h.sink.write_result(JobResult(id="done", status=JobStatus.COMPLETED, text="earlier"))
    h.journal.clear()
    h.put("done", job(2))
    stats = h.worker.run(burst=True)
    assert stats.num_skipped_done == 1
    assert h.engine.added == []
    assert h.result("done").text == "earlier"
    assert h.events("done") == ["ack"]
    assert h.queue.depth() == 0


def test_duplicate_delivery_while_running_is_acked_with_the_first():
    h = make_harness()
    h.put("dup", job(4))
    h.put("dup", job(4))
    stats = h.worker.run(burst=True)
    assert h.engine.added == ["dup"]
    assert stats.num_completed == 1
    assert h.events("dup") == ["deltas"] * 4 + ["result", "ack", "ack"]
    assert h.queue.depth() == 0


def test_too_many_deliveries_dead_letter_with_a_failed_result():
    h = make_harness(max_attempts=2)
    h.put("poison", job(2))
    peer = MemorySource(h.queue, consumer="peer")
    for _ in range(2):  # two deliveries that died without an ack
        peer.release(peer.lease(1, 0.0))
    stats = h.worker.run(burst=True)
    result = h.result("poison")
    assert (result.status, result.error.type, result.attempts) == (JobStatus.FAILED, "DeadLettered", 3)
    assert "delivered 3 times; max_attempts is 2" in result.error.message
    [dead] = h.queue.dead_letters
    assert dead.job_id == "poison" and dead.delivery_count == 3
    # The result first, so that a client waiting on the id hears why; then the message moves.
    assert h.events("poison") == ["result", "dead_letter"]
    assert (stats.num_dead_lettered, h.engine.added, h.queue.depth()) == (1, [], 0)


def test_max_attempts_stays_below_the_queue_own_limit():
    assert make_harness(max_attempts=5, max_deliveries=3).worker.max_attempts == 2
    assert make_harness(max_attempts=5, max_deliveries=None).worker.max_attempts == 5


# -- exits mid-run -----------------------------------------------------------------------------


def test_deadline_mid_run_stores_a_timeout_with_the_partial_output():
    h = make_harness()
    h.put("slow", job(20, timeout_s=0.2))
    h.put("other", job(6))
    h.engine.on_step = lambda step: time.sleep(0.3) if step == 3 else None
    stats = h.worker.run(burst=True)
    result = h.result("slow")
    assert (result.status, result.finish_reason, result.error.type) == (
        JobStatus.TIMEOUT,
        "timeout",
        "Timeout",
    )
    assert result.text == "abc"
    assert h.engine.aborted == ["slow"]
    assert h.events("slow") == ["deltas"] * 3 + ["result", "ack"]
    assert h.result("other").status is JobStatus.COMPLETED
    assert (stats.num_timeout, stats.num_completed) == (1, 1)


def test_cancel_mid_run_stores_a_cancelled_result_and_frees_the_engine():
    h = make_harness()
    h.put("a", job(20))
    h.put("b", job(6))
    h.engine.on_step = lambda step: h.sink.request_cancel("a") if step == 3 else None
    h.worker.run(burst=True)
    result = h.result("a")
    assert (result.status, result.finish_reason, result.text) == (JobStatus.CANCELLED, "cancelled", "abc")
    assert h.engine.aborted == ["a"]
    assert h.events("a") == ["deltas"] * 3 + ["result", "ack"]
    assert h.result("b").text == "abcdef"


def test_token_counters_move_as_tokens_are_generated_not_when_jobs_end():
    h = make_harness()
    h.put("a", job(20, prompt_token_ids=[1, 2, 3]))
    seen: list[tuple[float | None, float | None]] = []

    def sample(name: str) -> float | None:
        return h.worker.metrics.registry.get_sample_value(name)

    def on_step(step: int) -> None:
        seen.append((sample("qworker_prompt_tokens_total"), sample("qworker_generation_tokens_total")))
        if step == 5:
            h.sink.request_cancel("a")

    h.engine.on_step = on_step
    h.worker.run(burst=True)
    # While the job runs: its prompt counted once it entered the engine, its tokens step by step.
    assert seen[1] == (3.0, 1.0) and seen[3] == (3.0, 3.0), seen
    result = h.result("a")
    assert result.status is JobStatus.CANCELLED
    # A job that never completes still counts what it computed; nothing is counted twice at its end.
    assert sample("qworker_prompt_tokens_total") == result.usage.prompt_tokens == 3
    assert sample("qworker_generation_tokens_total") == result.usage.completion_tokens


def test_lease_lost_to_a_peer_drops_the_job_without_a_result():
    h = make_harness(lease_extend_interval_s=1e-6)
    h.put("a", job(20))
    peer = MemorySource(h.queue, consumer="peer")
    taken = []

    def stall(step: int) -> None:
        if step == 3:  # this worker stalled past its lease, and a peer took the job
            h.queue.expire()
            taken.extend(peer.lease(1, 0.0))

    h.engine.on_step = stall
    stats = h.worker.run(burst=True)
    assert [le.job_id for le in taken] == ["a"]
    assert stats.num_leases_lost == 1
    assert h.engine.aborted == ["a"]
    assert h.sink.results == {}
    assert "ack" not in h.events("a")
    # The peer still holds it and finishes it.
    assert h.queue.num_held_by("peer") == 1


def test_own_expired_lease_taken_back_runs_once():
    h = make_harness()
    h.put("a", job(6))
    h.engine.on_step = lambda step: h.queue.expire() if step == 2 else None
    stats = h.worker.run(burst=True)
    assert h.engine.added == ["a"]
    assert stats.num_completed == 1
    assert h.result("a").attempts == 2
    assert h.events("a")[-2:] == ["result", "ack"]
    assert h.queue.depth() == 0


# -- drain -------------------------------------------------------------------------------------


def test_sigterm_releases_what_cannot_finish_for_peers():
    h = make_harness(drain_grace_s=0.0)
    h.put("a", job(50))
    h.put("b", job(50))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    h.worker.install_signal_handlers()
    try:
        h.engine.on_step = lambda step: os.kill(os.getpid(), signal.SIGTERM) if step == 2 else None
        stats = h.worker.run(burst=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert stats.num_released == 2
    assert h.sink.results == {}
    assert sorted(h.engine.aborted) == ["a", "b"]
    assert not h.engine.has_unfinished_requests()
    assert h.events("a")[-1] == "release"
    assert h.queue.num_ready == 2
    # A peer takes them at once (no lease to wait out) and finishes them.
    peer = make_harness(queue=h.queue, name="w2")
    assert peer.worker.run(burst=True).num_completed == 2
    assert peer.result("a").attempts == 2
    assert len(peer.result("a").token_ids) == 50


def test_drain_finishes_what_can_finish_and_releases_what_has_not_started():
    # One sequence at a time: "b" waits in the engine with no output.
    engine = FakeEngine(EngineConfig(model="fake", block_size=4, num_kv_blocks=64, max_num_seqs=1))
    h = make_harness(engine, drain_grace_s=30.0)
    h.put("a", job(6))
    h.put("b", job(6))
    engine.on_step = lambda step: h.worker.stop() if step == 2 else None
    stats = h.worker.run()
    assert h.result("a").status is JobStatus.COMPLETED
    assert h.result("a").text == "abcdef"
    assert (stats.num_completed, stats.num_released) == (1, 1)
    assert h.events("b") == ["release"]
    assert h.queue.num_ready == 1


# -- the parts the loop is made of: intake (pure), the held set, the status counters ----------


@dataclass
class Facts:
    """IntakeFacts with fixed answers, recording which were asked."""

    held: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    last_errors: dict[str, str] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    def is_held(self, job_id: str) -> bool:
        self.asked.append("is_held")
        return job_id in self.held

    def is_result_pending(self, job_id: str) -> bool:
        self.asked.append("is_result_pending")
        return job_id in self.pending

    def has_result(self, job_id: str) -> bool:
        self.asked.append("has_result")
        return job_id in self.done

    def last_error(self, job_id: str) -> str | None:
        self.asked.append("last_error")
        return self.last_errors.get(job_id)

    def is_cancelled(self, job_id: str) -> bool:
        self.asked.append("is_cancelled")
        return job_id in self.cancelled


def lease(body: dict[str, Any] | bytes = b"", **fields: Any) -> Lease:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    defaults: dict[str, Any] = dict(message_id="m1", job_id="j", delivery_count=1, enqueued_at=None)
    return Lease(body=raw, **{**defaults, **fields})


def decide(the_lease: Lease, facts: Facts, job_id: str | None = "j", now: float = 1000.0) -> intake.Outcome:
    return intake.intake(the_lease, job_id, facts, max_attempts=3, now=now)


def test_intake_outcomes_in_order():
    good = job()
    assert isinstance(decide(lease(good), Facts(), job_id=None), intake.DeadLetter)
    unreadable = decide(lease(b"\xff", rejection="the id field is not UTF-8"), Facts(), job_id=None)
    assert unreadable == intake.DeadLetter(unreadable.lease, "Unreadable", "the id field is not UTF-8", None)
    # Held, pending and done come before anything about the message itself.
    bad = lease(b"not json", rejection="pickle", delivery_count=9)
    assert decide(bad, Facts(held={"j"})) == intake.JoinHeld("j", bad)
    assert decide(bad, Facts(pending={"j"})) == intake.AckDone("j", bad, is_result_pending=True)
    assert decide(bad, Facts(done={"j"})) == intake.AckDone("j", bad, is_result_pending=False)
    assert decide(bad, Facts()) == intake.DeadLetter(bad, "Rejected", "pickle", "j")
    # Past max_attempts: dead-lettered before its body is read, with the last error named.
    worn = lease(b"not json", delivery_count=4)
    outcome = decide(worn, Facts(last_errors={"j": "worker w1 was killed"}))
    assert isinstance(outcome, intake.DeadLetter) and outcome.kind == "DeadLettered"
    assert outcome.reason == "delivered 4 times; max_attempts is 3; last error: worker w1 was killed"
    assert decide(lease(b"not json"), Facts()).error.type == "InvalidJSON"  # type: ignore[union-attr]
    expired = decide(lease({**good, "ttl_s": 5}, enqueued_at=990.0), Facts(), now=1000.0)
    assert isinstance(expired, intake.Fail) and expired.error.type == "Expired"
    assert "waited 10.0s" in expired.error.message
    # A redelivery is not expired by ttl_s (it was taken in time once).
    assert isinstance(
        decide(lease({**good, "ttl_s": 5}, enqueued_at=990.0, delivery_count=2), Facts()), intake.Run
    )
    past = decide(lease(good, expires_at=999.0), Facts())
    assert isinstance(past, intake.Cancel) and past.error is not None and past.error.type == "Expired"
    assert decide(lease(good), Facts(cancelled={"j"})) == intake.Cancel(lease(good), "j", past.job, None)
    run = decide(lease(good), Facts())
    assert isinstance(run, intake.Run) and run.job.params.max_tokens == 5


def test_intake_asks_only_what_it_needs():
    facts = Facts(held={"j"})
    decide(lease(job()), facts)
    assert facts.asked == ["is_held"]
    facts = Facts()
    decide(lease(b"not json"), facts)
    assert facts.asked == ["is_held", "is_result_pending", "has_result"]  # no cancel read for a bad body
    facts = Facts()
    decide(lease(job(), delivery_count=4), facts)
    assert facts.asked[-1] == "last_error"
    facts = Facts()
    decide(lease(job()), facts)
    assert facts.asked == ["is_held", "is_result_pending", "has_result", "is_cancelled"]


def test_start_failures_and_unforeseen_errors():
    run = decide(lease(job()), Facts())
    assert isinstance(run, intake.Run)
    too_long = intake.start_failure(run, PromptTooLongError("prompt of 9 tokens; the context is 8"))
    assert isinstance(too_long, intake.DeadLetter) and too_long.job_id == "j"
    invalid = intake.start_failure(run, InvalidRequestError("no tokenizer"))
    assert isinstance(invalid, intake.Fail) and invalid.error.type == "InvalidRequestError"
    template = intake.start_failure(run, ValueError("bad template"))
    assert (
        isinstance(template, intake.Fail)
        and "cannot prepare the prompt: bad template" in template.error.message
    )
    oops = intake.unforeseen_failure(run.lease, None, KeyError("x"))
    assert (oops.kind, oops.job_id) == ("InternalError", None) and "KeyError" in oops.reason


def test_dropping_a_held_job_aborts_it_and_returns_every_lease():
    engine = FakeEngine()
    held = HeldJobs(engine)
    for job_id in ("a", "b"):
        engine.add_request(job_id, {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))
        held.add(HeldJob(Job(id=job_id, prompt="x"), lease(message_id=f"m-{job_id}", job_id=job_id), 3, None))
    held.join("a", lease(message_id="m-a", job_id="a", delivery_count=2))  # our own entry, renewed
    held.join("a", lease(message_id="dup", job_id="a"))  # a producer's duplicate
    dropped = held.drop("a")
    assert engine.aborted == ["a"] and "a" not in held
    assert [le.message_id for le in dropped.leases] == ["m-a", "dup"]
    assert dropped.leases[0].delivery_count == 2 and dropped.output is not None

    def failing_abort(request_id: str) -> None:
        raise RuntimeError("engine gone")

    engine.abort = failing_abort  # type: ignore[method-assign]
    [last] = held.drop_all()
    assert (last.held.job.id, last.output, len(held)) == ("b", None, 0)  # the leases come back anyway
    assert leases_of([last]) == [last.held.lease]


def test_every_result_status_has_a_counter():
    stats = WorkerStats()
    for status in JobStatus:
        stats.count_result(status)
    assert (stats.num_completed, stats.num_failed, stats.num_timeout, stats.num_cancelled) == (1, 1, 1, 1)
    assert set(RESULT_COUNTERS) == set(JobStatus)
