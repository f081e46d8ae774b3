"""The worker loop: take jobs the KV cache can serve, run them in one continuous batch, stream
their tokens out, store one result each, and only then ack them.

One iteration: (1) admission decides how many jobs to pull and the source leases them; each is
decoded and either resolved at once (bad input, expired, cancelled, already done) or added to the
engine; (2) one engine step; its deltas go out in one write and finished jobs get their results;
(3) housekeeping on timers: lease extension, cancel flags, deadlines, stats.

Writes go through an outbox: deltas, then results, then acks (or dead letters), in that order.
When the broker is away (retry.py), the outbox keeps them and retries on a backoff while the
engine keeps stepping for the jobs held; after a reconnect the leases are checked at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from qworker.engine.outputs import RequestOutput
from qworker.errors import EngineFailedError, EngineStepError, InvalidRequestError, PromptTooLongError
from qworker.worker.admission import AdmissionPolicy, AdmissionStats, HeldJobSize
from qworker.worker.engine_protocol import EngineProtocol
from qworker.worker.health import HealthState
from qworker.worker.jobs import (
    Job,
    JobDecodeError,
    JobError,
    JobResult,
    JobStatus,
    decode_job,
    resolve_job_id,
)
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outbox import Outbox, PendingFinal
from qworker.worker.results import build_result
from qworker.worker.retry import BrokerOutage, BrokerOutageError, is_transient
from qworker.worker.settings import WorkerSettings
from qworker.worker.sinks.base import Delta, ResultSink
from qworker.worker.sources.base import JobSource, Lease

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _HeldJob:
    """A job this worker holds a lease on and has handed to the engine."""

    job: Job
    lease: Lease
    num_prompt_tokens: int
    deadline: float | None
    num_output_tokens: int = 0
    # time.monotonic() of its latest token: the start of the next inter-token gap.
    last_token_at: float | None = None
    # The same job id delivered again while it runs (a producer's duplicate): acked with it.
    extra_leases: list[Lease] = field(default_factory=list)


@dataclass
class WorkerStats:
    admission: AdmissionStats | None = None
    num_completed: int = 0
    num_failed: int = 0
    num_timeout: int = 0
    num_cancelled: int = 0
    num_dead_lettered: int = 0
    num_released: int = 0
    # Redelivered jobs that already had a result: acked without running.
    num_skipped_done: int = 0
    num_leases_lost: int = 0
    num_steps: int = 0
    # Broker outages ridden out, and text deltas dropped because one lasted too long.
    num_broker_outages: int = 0
    num_deltas_dropped: int = 0


class Worker:
    """Serves jobs from `source` with `engine`, writing to `sink`. Call run(); stop() drains."""

    def __init__(
        self,
        engine: EngineProtocol,
        source: JobSource,
        sink: ResultSink,
        settings: WorkerSettings | None = None,
        *,
        metrics: WorkerMetrics | None = None,
        health: HealthState | None = None,
    ) -> None:
        """`metrics` and `health` are what the HTTP endpoints (health.py) serve; the worker keeps
        both up to date whether or not anything serves them."""
        self.engine = engine
        self.source = source
        self.sink = sink
        self.settings = settings or WorkerSettings()
        self.name = self.settings.name
        self.admission = AdmissionPolicy(
            block_size=engine.config.block_size,
            max_backlog=self.settings.max_backlog,
            reserve_blocks_per_seq=self.settings.reserve_blocks_per_seq,
            max_jobs_held=engine.config.max_num_seqs + self.settings.max_backlog,
        )
        self.stats = WorkerStats()
        self.metrics = metrics or WorkerMetrics()
        self.health = health or HealthState()
        self._held: dict[str, _HeldJob] = {}
        # Written for each job as it enters the engine (one round trip per pull): read back only
        # if the attempt never ends here, to say why the job is later dead-lettered.
        self._attempt_notes: dict[str, str] = {}
        self._num_step_failures = 0
        self.outage = BrokerOutage(self.settings.broker_outage_s)
        # Writes not yet made (the broker is away, or they are this step's).
        self.outbox = Outbox()
        # Leased messages not yet taken (the broker went away while taking them).
        self._intake: list[Lease] = []
        self._stop = threading.Event()
        self._drain_deadline: float | None = None
        # Seconds per engine step, smoothed: estimates whether a job can finish during a drain.
        self._step_seconds = 0.05
        extend_every = self.settings.lease_extend_interval_s or source.lease_timeout_s / 3
        self._timers = {
            "extend": (extend_every, 0.0),
            "cancel": (self.settings.cancel_check_interval_s, 0.0),
            "stats": (self.settings.stats_interval_s, 0.0),
        }

    # -- control -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Begin a drain: stop pulling, finish what can finish within the grace, release the rest."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: self.stop())

    @property
    def max_attempts(self) -> int:
        """Deliveries before a job is dead-lettered: the setting, or one less than the queue's own
        limit (an SQS RedrivePolicy) when that is lower, so that the worker, not the queue, moves
        the message and records why."""
        limit = self.source.max_deliveries
        if limit is not None and limit >= 2:
            return min(self.settings.max_attempts, limit - 1)
        return self.settings.max_attempts

    @property
    def num_jobs_held(self) -> int:
        return len(self._held)

    def run(self, burst: bool = False) -> WorkerStats:
        """Serve until stop() (then drain) or, with burst=True, until the queue has nothing left."""
        logger.info("worker %s started", self.name)
        is_main_thread = threading.current_thread() is threading.main_thread()
        if not is_main_thread and self.engine.device.type == "cpu":
            logger.warning(
                "worker %s runs the engine off the main thread: torch's CPU thread pool runs the same "
                "matmuls 1.3-1.7x slower there; run the worker on the main thread and the rest in threads",
                self.name,
            )
        # The model is loaded (the engine exists) and the source connected when it was opened.
        self.health.set_ready(True)
        try:
            while True:
                self.health.tick()
                self.outage.check_limit()
                if self._stop.is_set() and self._drain_deadline is None:
                    self._begin_drain()
                if self._drain_deadline is not None:
                    self._drain_tick()
                    if not self._held and not self.outbox.has_finals:
                        break
                else:
                    num_leased = self._pull(block=not self._held and not burst)
                    is_settled = not self._held and not self.outbox.has_finals and not self.outage.is_down
                    if burst and num_leased == 0 and is_settled:
                        break
                self._flush()
                self._housekeeping()
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self.outage.is_down:
                    # Nothing to compute: wait for the next try rather than spin.
                    time.sleep(min(0.5, max(0.0, self.outage.next_try_at - time.monotonic())))
        except BrokerOutageError as exc:
            self._give_up(str(exc))
            raise
        self._write_stats(self.admission_stats())
        logger.info("worker %s stopped: %s", self.name, self.stats)
        return self.stats

    # -- admission and intake ----------------------------------------------------------------

    def admission_stats(self) -> AdmissionStats:
        kv = self.engine.kv_stats()
        jobs = [
            HeldJobSize(
                h.num_prompt_tokens,
                # n completions each grow to max_tokens (only completion 0's tokens are streamed
                # and counted below, so this errs on the side of more blocks).
                h.job.params.max_tokens * h.job.params.n,
                h.num_output_tokens,
                h.num_output_tokens > 0,
                0 if h.num_output_tokens else self.engine.num_cached_prefix_tokens(h.job.id),
            )
            for h in self._held.values()
        ]
        decision = self.admission.decide(kv.num_total_blocks, kv.num_free_blocks, jobs)
        self.stats.admission = decision
        return decision

    def _pull(self, block: bool) -> int:
        if not self.outage.may_try():
            return 0
        if not self._intake:
            decision = self.admission_stats()
            if decision.num_jobs_to_pull == 0:
                return 0
            try:
                self._intake = self.source.lease(
                    decision.num_jobs_to_pull,
                    self.settings.poll_interval_s if block else 0.0,
                    is_idle=not self._held,
                )
            except Exception as exc:
                self._on_broker_error(exc, "leasing jobs")
                return 0
            self._on_broker_ok()
        num_leased = len(self._intake)
        while self._intake:
            try:
                # Only reads reach the broker before a job enters the engine (writes go to the
                # outbox), so a message that failed part-way is taken again from the start.
                self._take_safely(self._intake[0])
            except Exception as exc:
                self._on_broker_error(exc, "taking a job")
                return num_leased
            self._intake.pop(0)
        if self._attempt_notes:
            notes, self._attempt_notes = self._attempt_notes, {}
            self._best_effort("writing attempt notes", lambda: self.sink.write_last_errors(notes))
        return num_leased

    def _take_safely(self, lease: Lease) -> None:
        """_take, with an error it did not foresee confined to this one message: the message is
        dead-lettered with the error (and its job, when it has an id, gets a failed result), and
        the rest of the batch goes on."""
        try:
            self._take(lease)
        except Exception as exc:
            if is_transient(exc) or isinstance(exc, BrokerOutageError):
                raise  # the broker is away, not this message at fault: taken again later
            reason = f"internal error while taking the job: {type(exc).__name__}: {exc}"
            logger.error("message %s: %s", lease.message_id, reason)
            logger.debug("message %s: the error", lease.message_id, exc_info=True)
            job_id = resolve_job_id(lease.job_id, lease.body, self.source.queue_name, lease.message_id)
            try:
                if job_id is None:
                    self._dead_letter(lease, "InternalError", reason)
                    return
                if job_id not in self._held:
                    self.engine.abort(job_id)  # in case it got that far
                self._fail_and_dead_letter(lease, job_id, "InternalError", reason)
            except Exception:
                # Its lease expires and a later attempt, past max_attempts, dead-letters it first.
                logger.exception("message %s: cannot dead-letter it either", lease.message_id)

    def _take(self, lease: Lease) -> None:
        """Decode one leased message and resolve it at once or hand it to the engine."""
        job_id = resolve_job_id(lease.job_id, lease.body, self.source.queue_name, lease.message_id)
        if job_id is None:
            reason = (
                lease.rejection or "cannot read a job id: the body is not a JSON object and has no id field"
            )
            self._dead_letter(lease, "Unreadable", reason)
            return
        held = self._held.get(job_id)
        if held is not None:
            if lease.message_id == held.lease.message_id:
                held.lease = lease  # our own entry again: the lease was renewed by the claim
            else:
                held.extra_leases.append(lease)
            return
        pending = self.outbox.final_for(job_id)
        if pending is not None:
            # Its result waits in the outbox (the broker was away): acked with it.
            if all(le.message_id != lease.message_id for le in pending.leases):
                pending.leases.append(lease)
            return
        if self.sink.has_result(job_id):
            self.stats.num_skipped_done += 1
            self._send_final(PendingFinal(None, [lease]))
            return
        if lease.rejection is not None:
            self._fail_and_dead_letter(lease, job_id, "Rejected", lease.rejection)
            return
        # Before anything that reads the body: a message that broke every attempt so far is not
        # given another chance to.
        if lease.delivery_count > self.max_attempts:
            reason = f"delivered {lease.delivery_count} times; max_attempts is {self.max_attempts}"
            last_error = self.sink.last_error(job_id)
            if last_error:
                reason += f"; last error: {last_error}"
            self._fail_and_dead_letter(lease, job_id, "DeadLettered", reason)
            return
        if self.settings.log_payloads:
            logger.debug("job %s payload: %r", job_id, lease.body)
        try:
            job = decode_job(lease.body, job_id)
        except JobDecodeError as exc:
            self._fail(lease, job_id, None, exc.error_type, exc.message)
            return
        now = time.time()
        if job.ttl_s is not None and lease.delivery_count == 1 and lease.enqueued_at is not None:
            waited = now - lease.enqueued_at
            if waited > job.ttl_s:
                self._fail(
                    lease, job_id, job, "Expired", f"waited {waited:.1f}s in the queue; ttl_s is {job.ttl_s}"
                )
                return
        if lease.expires_at is not None and now > lease.expires_at:
            message = f"the message expired {now - lease.expires_at:.1f}s before it was taken"
            error = JobError(type="Expired", message=message)
            self._finish_without_engine(lease, job_id, job, JobStatus.CANCELLED, error)
            return
        if self.sink.cancelled_ids([job_id]) or self.source.revoked_ids([job_id]):
            self._finish_without_engine(lease, job_id, job, JobStatus.CANCELLED, None)
            return
        try:
            prompt = self._prompt(job)
            self.engine.add_request(
                job_id, prompt, job.params, priority=job.priority, arrival_time=lease.enqueued_at or now
            )
        except PromptTooLongError as exc:
            # It may fit a worker with a longer context: kept in the dead-letter queue to replay.
            self._fail_and_dead_letter(lease, job_id, type(exc).__name__, str(exc))
            return
        except InvalidRequestError as exc:
            self._fail(lease, job_id, job, type(exc).__name__, str(exc))
            return
        except Exception as exc:  # a tokenizer or chat template that rejects this input
            # The traceback may quote the input: only with payload logging on.
            logger.warning("job %s: cannot prepare its prompt", job_id, exc_info=self.settings.log_payloads)
            self._fail(lease, job_id, job, "InvalidRequestError", f"cannot prepare the prompt: {exc}")
            return
        if lease.delivery_count > 1:
            # This attempt streams from the start: live readers drop what earlier ones streamed.
            self.outbox.add_deltas([Delta(job_id, "", attempt=lease.delivery_count)])
        self._attempt_notes[job_id] = (
            f"attempt {lease.delivery_count} (worker {self.name}, begun "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}) ended without a result: "
            "its worker was killed or crashed, or lost the job's lease"
        )
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        self.admission.observe_prompt(num_prompt_tokens, self.engine.num_cached_prefix_tokens(job_id))
        limits = [t for t in (job.timeout_s, lease.time_limit_s) if t is not None]
        deadline = now + min(limits) if limits else None
        self._held[job_id] = _HeldJob(job, lease, num_prompt_tokens, deadline)

    def _prompt(self, job: Job) -> dict[str, Any]:
        """The job's prompt as token ids (so that admission knows its size before the engine does)."""
        if job.prompt_token_ids is not None:
            return {"prompt_token_ids": list(job.prompt_token_ids)}
        if self.engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids")
        if job.messages is not None:
            return {
                "prompt_token_ids": self.engine.apply_chat_template([m.model_dump() for m in job.messages])
            }
        assert job.prompt is not None, "Job validation guarantees one prompt form"
        text, token_ids = self.engine.tokenize(job.prompt)
        return {"prompt": text, "prompt_token_ids": token_ids}

    # -- the engine step ---------------------------------------------------------------------

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            step_outputs = self.engine.step()
        except Exception as exc:
            self._on_step_failure(exc)
            return
        self._num_step_failures = 0
        self.stats.num_steps += 1
        self.metrics.observe_step()
        now = time.monotonic()
        deltas = []
        finished = []
        for out in step_outputs:
            held = self._held.get(out.request_id)
            if held is None:
                continue
            if out.new_token_ids:
                if held.last_token_at is not None:
                    self.metrics.observe_itl(now - held.last_token_at)
                held.last_token_at = now
            held.num_output_tokens += len(out.new_token_ids)
            if out.text_delta or out.new_token_ids:
                deltas.append(Delta(out.request_id, out.text_delta, list(out.new_token_ids)))
            if out.finished:
                finished.append((held, out.output))
        # Deltas first: a live reader sees every delta before the done marker of the result.
        self.outbox.add_deltas(deltas)
        for held, output in finished:
            assert output is not None, "a finished step output carries the whole result"
            self._complete(held, output, JobStatus.COMPLETED, None)
        self._flush()
        elapsed = time.perf_counter() - started
        self._step_seconds += 0.2 * (elapsed - self._step_seconds)

    def _on_step_failure(self, exc: Exception) -> None:
        """engine.step raised. The jobs of that step (every held job, when the engine cannot say
        which) get a failed result (InternalError, with the exception's message) and leave the
        engine, which frees their blocks; the worker carries on. After max_step_failures in a
        row the engine is broken, not a job: every held job goes back to the queue for a peer and
        the worker stops with EngineFailedError."""
        self._num_step_failures += 1
        limit = self.settings.max_step_failures
        message = str(exc) if isinstance(exc, EngineStepError) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, EngineStepError):
            job_ids = [job_id for job_id in exc.request_ids if job_id in self._held]
        else:
            job_ids = list(self._held)
        logger.error(
            "worker %s: engine step failed (%d in a row, limit %d) with %d jobs in it: %s",
            self.name, self._num_step_failures, limit, len(job_ids), message,
        )  # fmt: skip
        logger.debug("the engine step's error", exc_info=exc)
        if self._num_step_failures >= limit:
            reason = f"worker {self.name} stopped: its engine failed {limit} steps in a row: {message}"
            self._hand_back_all(reason)
            raise EngineFailedError(reason, self._num_step_failures) from exc
        error = JobError(type="InternalError", message=f"the engine failed while running this job: {message}")
        for job_id in job_ids:
            held = self._held[job_id]
            try:
                output = self.engine.abort(job_id)
            except Exception:
                logger.debug("job %s: abort after the failed step failed too", job_id, exc_info=True)
                output = None
            self._complete(held, output, JobStatus.FAILED, error)

    def _hand_back_all(self, reason: str) -> None:
        """Release every held job at once (their next attempt is a peer's), noting `reason` as
        their last error."""
        held = list(self._held.values())
        for h in held:
            try:
                self.engine.abort(h.job.id)
            except Exception:
                logger.debug("job %s: abort failed", h.job.id, exc_info=True)
        self._held.clear()
        self._best_effort(
            "noting the hand-back", lambda: self.sink.write_last_errors({h.job.id: reason for h in held})
        )
        leases = [le for h in held for le in (h.lease, *h.extra_leases)]
        self._best_effort("releasing jobs", lambda: self.source.release(leases))
        self.stats.num_released += len(held)
        self.metrics.observe_released(len(held))
        logger.info("worker %s released %d jobs to its peers", self.name, len(held))

    # -- resolving jobs ----------------------------------------------------------------------

    def _store_and_ack(self, result: JobResult, leases: list[Lease]) -> None:
        """The one place a job ends: its result is stored, and only then is its message acked."""
        if self.settings.log_payloads:
            logger.debug("job %s result (%s): %r", result.id, result.status.value, result.text)
        self._send_final(PendingFinal(result, list(leases)))
        counter = f"num_{result.status.value}"
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _complete(
        self, held: _HeldJob, output: RequestOutput | None, status: JobStatus, error: JobError | None
    ) -> None:
        self._held.pop(held.job.id, None)
        if output is not None:
            self.metrics.observe_preemptions(output.num_preemptions)
        result = build_result(held.job.id, held.job, held.lease, status, error, output, self.name)
        self._store_and_ack(result, [held.lease, *held.extra_leases])

    def _finish_without_engine(
        self, lease: Lease, job_id: str, job: Job | None, status: JobStatus, error: JobError | None
    ) -> None:
        self._store_and_ack(build_result(job_id, job, lease, status, error, None, self.name), [lease])

    def _fail(self, lease: Lease, job_id: str, job: Job | None, error_type: str, message: str) -> None:
        # The message may quote the input (a validation error shows the offending value).
        if self.settings.log_payloads:
            logger.info("job %s failed: %s: %s", job_id, error_type, message[:200])
        else:
            logger.info("job %s failed: %s", job_id, error_type)
        self._finish_without_engine(
            lease, job_id, job, JobStatus.FAILED, JobError(type=error_type, message=message)
        )

    def _fail_and_dead_letter(self, lease: Lease, job_id: str, error_type: str, reason: str) -> None:
        error = JobError(type=error_type, message=reason)
        # The result first, so that a client waiting on this id hears why; then the message moves.
        result = build_result(job_id, None, lease, JobStatus.FAILED, error, None, self.name)
        self._dead_letter(lease, error_type, reason, result)

    def _dead_letter(self, lease: Lease, kind: str, reason: str, result: JobResult | None = None) -> None:
        """`kind`: a short fixed name (the metric's label), `reason`: the words for people;
        `result`, stored first, so that a client waiting on the job hears why."""
        logger.warning("message %s dead-lettered: %s", lease.message_id, reason)
        self._send_final(PendingFinal(result, [lease], dead_letter=(kind, reason)))
        self.stats.num_dead_lettered += 1
        self.metrics.observe_dead_letter(kind)

    def _abort(self, held: _HeldJob, status: JobStatus, error: JobError | None) -> None:
        """Stop a held job in the engine (freeing its blocks) and store its partial result."""
        output = self.engine.abort(held.job.id)
        self._complete(held, output, status, error)

    # -- housekeeping ------------------------------------------------------------------------

    def _due(self, timer: str) -> bool:
        interval, last = self._timers[timer]
        now = time.monotonic()
        if now - last < interval:
            return False
        self._timers[timer] = (interval, now)
        return True

    def _housekeeping(self) -> None:
        now = time.time()
        for held in [h for h in self._held.values() if h.deadline is not None and now >= h.deadline]:
            limit = min(t for t in (held.job.timeout_s, held.lease.time_limit_s) if t is not None)
            message = f"job ran past its time limit of {limit}s"
            self._abort(held, JobStatus.TIMEOUT, JobError(type="Timeout", message=message))
        if not self.outage.may_try():
            return
        if self._held and self._due("cancel"):
            try:
                held_ids = list(self._held)
                cancelled = self.sink.cancelled_ids(held_ids) | self.source.revoked_ids(held_ids)
            except Exception as exc:
                self._on_broker_error(exc, "reading cancel flags")
                return
            self._on_broker_ok()
            for job_id in cancelled:
                self._abort(self._held[job_id], JobStatus.CANCELLED, None)
        if self._held and self._due("extend"):
            leases = [le for h in self._held.values() for le in (h.lease, *h.extra_leases)]
            try:
                lost = {le.message_id for le in self.source.extend(leases)}
            except Exception as exc:
                self._on_broker_error(exc, "extending leases")
                return
            self._on_broker_ok()
            for held in [h for h in self._held.values() if h.lease.message_id in lost]:
                # A peer owns the message now and will run it; running it too would only waste work.
                logger.warning("job %s: lease lost to a peer; dropping it here", held.job.id)
                self.engine.abort(held.job.id)
                self._held.pop(held.job.id)
                self.stats.num_leases_lost += 1
                self.metrics.observe_lease_lost()
        if self._due("stats"):
            self._write_stats(self.admission_stats())

    def _write_stats(self, admission: AdmissionStats) -> None:
        logger.debug(
            "worker %s: %d held (%d not started), %d free blocks, %d reserved, %d committed",
            self.name,
            admission.num_jobs_held,
            admission.num_jobs_not_started,
            admission.num_free_blocks,
            admission.num_reserved_blocks,
            admission.num_committed_blocks,
        )
        self.stats.num_broker_outages = self.outage.num_outages
        self.stats.num_deltas_dropped = self.outbox.num_deltas_dropped
        self._best_effort("writing worker stats", lambda: self.sink.write_worker_stats(self.name, self.stats))
        # As the worker sees them: a job runs once it produced a token, and waits in the engine
        # before that (queued or still prefilling).
        num_waiting = admission.num_jobs_not_started
        kv = self.engine.kv_stats()
        self.metrics.set_engine_gauges(
            kv,
            num_running=admission.num_jobs_held - num_waiting,
            num_waiting=num_waiting,
            num_held=admission.num_jobs_held,
            headroom_blocks=admission.num_headroom_blocks,
            num_cached_blocks=kv.num_cached_blocks,
        )

    # -- the outbox and broker outages ----------------------------------------------------------

    def _send_final(self, final: PendingFinal) -> None:
        self.outbox.add_final(final)
        self._flush()

    def _flush(self) -> None:
        """Write what waits (outbox.py); a broker error stops it and counts toward the outage
        (the next try is on its backoff)."""
        if self.outbox.is_empty or not self.outage.may_try():
            return
        try:
            self.outbox.flush(self.sink, self.source, self._on_result_stored)
        except Exception as exc:
            self._on_broker_error(exc, "writing results")
            return
        self._on_broker_ok()

    def _on_result_stored(self, result: JobResult, is_new: bool) -> None:
        if is_new:
            self.metrics.observe_result(result)
        else:
            logger.info("job %s already had a result; keeping that one", result.id)

    def _on_broker_error(self, exc: Exception, what: str) -> None:
        """A broker call failed: a transient error counts toward the outage (raising
        BrokerOutageError past its limit); any other is re-raised."""
        if not is_transient(exc):
            raise exc
        self.outage.failed(exc, what)
        self.health.set_broker_outage(self.outage.last_error)

    def _on_broker_ok(self) -> None:
        if self.outage.succeeded():
            self.health.set_broker_outage(None)
            self.stats.num_broker_outages = self.outage.num_outages
            # Check the leases now: a peer may have reclaimed a job while the broker was away,
            # or the broker restarted without the stream.
            interval, _ = self._timers["extend"]
            self._timers["extend"] = (interval, 0.0)

    def _best_effort(self, what: str, call: Callable[[], object]) -> bool:
        """Make a broker call whose loss costs nothing lasting (stats, notes, a release that the
        lease's expiry stands in for); True if it was made."""
        if not self.outage.may_try():
            return False
        try:
            call()
        except Exception as exc:
            self._on_broker_error(exc, what)
            return False
        self._on_broker_ok()
        return True

    def _give_up(self, reason: str) -> None:
        """The outage lasted the limit: free the engine, try once to release the held jobs (their
        leases expire otherwise), and let the error end the worker."""
        logger.error("worker %s gives up: %s", self.name, reason)
        held = list(self._held.values())
        for h in held:
            try:
                self.engine.abort(h.job.id)
            except Exception:
                logger.debug("job %s: abort failed", h.job.id, exc_info=True)
        self._held.clear()
        leases = [le for h in held for le in (h.lease, *h.extra_leases)]
        try:
            self.source.release(leases)
        except Exception:
            logger.info("worker %s: could not release %d jobs; their leases expire", self.name, len(leases))
        num_unstored = self.outbox.num_unstored_results
        logger.error(
            "worker %s stopped after a broker outage: %d jobs held, %d results not stored: %s",
            self.name, len(held), num_unstored, self.stats,
        )  # fmt: skip

    # -- drain -------------------------------------------------------------------------------

    def _begin_drain(self) -> None:
        self._drain_deadline = time.monotonic() + self.settings.drain_grace_s
        self.health.set_draining()
        logger.info(
            "worker %s draining: %d jobs held, grace %.1fs",
            self.name,
            len(self._held),
            self.settings.drain_grace_s,
        )

    def _drain_tick(self) -> None:
        """Release every held job that cannot finish before the grace period ends."""
        assert self._drain_deadline is not None
        # Keep a margin for releasing and exiting.
        time_left = self._drain_deadline - time.monotonic() - max(0.5, 3 * self._step_seconds)
        to_release = []
        for held in self._held.values():
            if held.num_output_tokens == 0:
                # Not started: a peer can start it as soon as we could.
                to_release.append(held)
                continue
            steps_left = held.job.params.max_tokens - held.num_output_tokens
            if steps_left * self._step_seconds > time_left:
                to_release.append(held)
        if not to_release:
            return
        for held in to_release:
            self.engine.abort(held.job.id)
            self._held.pop(held.job.id)
        note = f"attempt released by worker {self.name} during a drain (SIGTERM)"
        self._best_effort(
            "noting the drain", lambda: self.sink.write_last_errors({h.job.id: note for h in to_release})
        )
        leases = [le for h in to_release for le in (h.lease, *h.extra_leases)]
        # If the broker is away, the leases expire and peers take the jobs.
        self._best_effort("releasing jobs", lambda: self.source.release(leases))
        self.stats.num_released += len(to_release)
        self.metrics.observe_released(len(to_release))
        logger.info("worker %s released %d jobs to its peers", self.name, len(to_release))


def run_beside(worker: Worker, task: Callable[[], T]) -> T:
    """Serve with `worker` on this thread while `task` runs in another; stop the worker (a drain)
    when the task ends, then return the task's value or raise its exception here.

    For a process that is both worker and client (the demo, benchmarks): the worker, so the
    engine, keeps the main thread, because torch's CPU thread pool runs the same matmuls 1.3-1.7x
    slower when a second Python thread drives it; the task should only do I/O.
    """
    outcome: dict[str, Any] = {}

    def side() -> None:
        try:
            outcome["value"] = task()
        except BaseException as exc:  # re-raised on the calling thread
            outcome["error"] = exc
        finally:
            worker.stop()

    thread = threading.Thread(target=side, name=f"{worker.name}-beside", daemon=True)
    thread.start()
    worker.run()
    # The worker stops when the task ends, but also on a signal: then the task is given a while.
    thread.join(timeout=60)
    if thread.is_alive():
        raise RuntimeError("the worker stopped while its side task was still running")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
