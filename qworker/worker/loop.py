"""The worker loop: take jobs the KV cache can serve, run them in one continuous batch, stream
their tokens out, store one result each, and only then ack them.

One iteration: (1) admission decides how many jobs to pull and the source leases them; each goes
through intake (intake.py), which ends it at once (bad input, expired, cancelled, already done)
or starts it in the engine and holds it (held.py); (2) one engine step; its deltas go out in one
write and finished jobs get their results; (3) housekeeping on timers: lease extension, cancel
flags, deadlines, stats. Every job ends through finish.py, whose writes go through the outbox:
deltas, then results, then acks (or dead letters), in that order.

When the broker is away (retry.py, broker_calls.py), the outbox keeps the writes and retries on
a backoff while the engine keeps stepping for the jobs held; after a reconnect the leases are
checked at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from qworker.backends.sink import Delta, ResultSink
from qworker.backends.source import JobSource, Lease
from qworker.engine.outputs import RequestOutput
from qworker.errors import EngineFailedError, EngineStepError
from qworker.health import HealthState
from qworker.jobs.job import JobError, JobStatus
from qworker.lora.adapter_list import AdapterList
from qworker.worker.admission import AdmissionPolicy, AdmissionStats
from qworker.worker.broker_calls import BrokerCalls
from qworker.worker.drain import Drain
from qworker.worker.engine_protocol import EngineProtocol
from qworker.worker.finish import Finisher
from qworker.worker.held import HeldJobs, leases_of
from qworker.worker.lease_keeper import StepLeaseKeeper
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outbox import Outbox
from qworker.worker.pooling import collect_pooled
from qworker.worker.report import ReportFiller
from qworker.worker.retry import BrokerOutage, BrokerOutageError
from qworker.worker.run_beside import run_beside
from qworker.worker.settings import WorkerSettings
from qworker.worker.stats import WorkerStats
from qworker.worker.take import Taker
from qworker.worker.timers import Timers

# WorkerStats and run_beside have their own modules; callers import them from here too.
__all__ = ["Worker", "WorkerStats", "run_beside"]

logger = logging.getLogger(__name__)


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
        self._sink = sink
        self.settings = settings or WorkerSettings()
        self.name = self.settings.name
        self.admission = AdmissionPolicy(
            block_size=engine.config.block_size,
            max_backlog=self.settings.max_backlog,
            reserve_blocks_per_seq=self.settings.reserve_blocks_per_seq,
            max_jobs_held=engine.config.max_num_seqs + self.settings.max_backlog,
            pooling_token_budget=2 * engine.config.max_num_batched_tokens,
        )
        self.stats = WorkerStats()
        self._report = ReportFiller(self.settings.stats_interval_s)  # the dashboard's fields
        self.metrics = metrics or WorkerMetrics()
        self.health = health or HealthState()
        self.held = HeldJobs(engine)
        self._num_step_failures = 0
        self.outage = BrokerOutage(self.settings.broker_outage_s)
        self.broker = BrokerCalls(self.outage, self.health, self._on_broker_recovered)
        # Writes not yet made (the broker is away, or they are this step's).
        self.outbox = Outbox()
        self.finish = Finisher(
            worker_name=self.name,
            outbox=self.outbox,
            sink=sink,
            source=source,
            broker=self.broker,
            stats=self.stats,
            metrics=self.metrics,
            log_payloads=self.settings.log_payloads,
        )
        self.taker = Taker(
            worker_name=self.name,
            engine=engine,
            source=source,
            sink=sink,
            held=self.held,
            outbox=self.outbox,
            finish=self.finish,
            admission=self.admission,
            metrics=self.metrics,
            log_payloads=self.settings.log_payloads,
            adapters=AdapterList.of(self.settings.lora_modules, self.settings.lora_dir),
        )
        # Leased messages not yet taken (the broker went away while taking them).
        self._intake: list[Lease] = []
        self._stop = threading.Event()
        self.drain = Drain(self.name, self.settings.drain_grace_s)
        # Seconds per engine step, smoothed: estimates whether a job can finish during a drain.
        self._step_seconds = 0.05
        extend_every = self.settings.lease_extend_interval_s or source.lease_timeout_s / 3
        self._timers = Timers(
            {
                "extend": extend_every,
                "cancel": self.settings.cancel_check_interval_s,
                "stats": self.settings.stats_interval_s,
            }
        )
        self._lease_keeper = StepLeaseKeeper(source, lambda: leases_of(self.held), extend_every)

    @property
    def sink(self) -> ResultSink:
        return self._sink

    @sink.setter
    def sink(self, sink: ResultSink) -> None:
        """Swap the result store (tests hand a peer worker its predecessor's store)."""
        self._sink = self.finish.sink = self.taker.sink = sink

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
        return len(self.held)

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
        self._lease_keeper.start()
        try:
            while True:
                self.health.tick()
                self.outage.check_limit()
                if self._stop.is_set() and not self.drain.is_draining:
                    self.drain.begin(len(self.held))
                    self.health.set_draining()
                if self.drain.is_draining:
                    self._drain_tick()
                    if not self.held and not self.outbox.has_finals:
                        break
                else:
                    num_leased = self._pull(block=not self.held and not burst)
                    is_settled = not self.held and not self.outbox.has_finals and not self.outage.is_down
                    if burst and num_leased == 0 and is_settled:
                        break
                self.finish.flush()
                self._housekeeping()
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self.outage.is_down:
                    # Nothing to compute: wait for the next try rather than spin.
                    time.sleep(min(0.5, max(0.0, self.outage.next_try_at - time.monotonic())))
        except BrokerOutageError as exc:
            self._give_up(str(exc))
            raise
        finally:
            self._lease_keeper.stop()
        self._write_stats(self.admission_stats())
        logger.info("worker %s stopped: %s", self.name, self.stats)
        return self.stats

    # -- admission and intake ----------------------------------------------------------------

    def admission_stats(self) -> AdmissionStats:
        kv = self.engine.kv_stats()
        decision = self.admission.decide(kv.num_total_blocks, kv.num_free_blocks, self.held.sizes())
        self.stats.admission = decision
        return decision

    def _pull(self, block: bool) -> int:
        if not self.broker.may_try():
            return 0
        if not self._intake:
            decision = self.admission_stats()
            if decision.num_jobs_to_pull == 0:
                return 0
            wait_s = self.settings.poll_interval_s if block else 0.0
            leased = self.broker.fetch(
                "leasing jobs",
                lambda: self.source.lease(decision.num_jobs_to_pull, wait_s, is_idle=not self.held),
            )
            if leased is None:
                return 0
            self._intake = leased
        num_leased = len(self._intake)
        try:
            while self._intake:
                try:
                    # Only reads reach the broker before a job enters the engine (writes go to the
                    # outbox), so a message that failed part-way is taken again from the start.
                    self.taker.take(self._intake[0], self.max_attempts)
                except Exception as exc:
                    self.broker.failed(exc, "taking a job")
                    return num_leased
                self._intake.pop(0)
        finally:
            # The pooling jobs taken (held already): their inputs enter the engine sorted by length.
            self.taker.add_pooled_requests()
        notes = self.taker.pop_attempt_notes()
        if notes:
            self.broker.make("writing attempt notes", lambda: self.sink.write_last_errors(notes))
        return num_leased

    # -- the engine step ---------------------------------------------------------------------

    def _step(self) -> None:
        started = time.perf_counter()
        self._lease_keeper.step_started()
        try:
            step_outputs = self.engine.step()
        except Exception as exc:
            self._drop_lost(self._lease_keeper.step_ended())
            self._on_step_failure(exc)
            return
        # Before the outputs: a job a peer took over during the step is not finished here.
        self._drop_lost(self._lease_keeper.step_ended())
        self._num_step_failures = 0
        self.stats.num_steps += 1
        self.metrics.observe_step()
        now = time.monotonic()
        deltas = []
        finished = []
        num_generated = 0
        pooled_done = []
        for out in step_outputs:
            held = self.held.owner_of(out.request_id)
            if held is None:
                continue
            if held.fan_in is not None:
                if out.finished and collect_pooled(held.fan_in, out):
                    pooled_done.append(held)
                continue
            if out.new_token_ids:
                if held.last_token_at is not None:
                    self.metrics.observe_itl(now - held.last_token_at)
                held.last_token_at = now
            # The delta's first token's place in the output: the stream is the job's checkpoint.
            pos = held.num_resumed_tokens + held.num_output_tokens
            held.num_output_tokens += len(out.new_token_ids)
            num_generated += len(out.new_token_ids)
            if out.text_delta or out.new_token_ids:
                deltas.append(Delta(out.request_id, out.text_delta, list(out.new_token_ids), pos=pos))
            if out.finished:
                finished.append((held, out.output))
        # Counted as generated, not when a job ends: tokens of jobs that are killed, released or
        # still running count too, and rate() is smooth.
        self.metrics.observe_generated_tokens(num_generated)
        # Deltas first: a live reader sees every delta before the done marker of the result.
        self.outbox.add_deltas(deltas)
        for held, output in finished:
            assert isinstance(output, RequestOutput), "a finished generation step carries its whole result"
            self.finish.end_held(self.held.pop_finished(held.job.id), output, JobStatus.COMPLETED, None)
        for held in pooled_done:
            assert held.fan_in is not None, "pooled_done holds pooling jobs"
            if held.fan_in.error is not None:  # the engine failed one input: the job fails whole
                self.finish.end_dropped(self.held.drop(held.job.id), JobStatus.FAILED, held.fan_in.error)
            else:
                self.finish.end_held(self.held.pop_finished(held.job.id), None, JobStatus.COMPLETED, None)
        self.finish.flush()
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
            # A pooling job's requests are named {job_id}:{i}: the job they belong to fails.
            owners = (self.held.owner_of(request_id) for request_id in exc.request_ids)
            job_ids = list(dict.fromkeys(h.job.id for h in owners if h is not None))
        else:
            job_ids = self.held.ids()
        logger.error(
            "worker %s: engine step failed (%d in a row, limit %d) with %d jobs in it: %s",
            self.name, self._num_step_failures, limit, len(job_ids), message,
        )  # fmt: skip
        logger.debug("the engine step's error", exc_info=exc)
        if self._num_step_failures >= limit:
            reason = f"worker {self.name} stopped: its engine failed {limit} steps in a row: {message}"
            self.finish.release(self.held.drop_all(), reason)
            raise EngineFailedError(reason, self._num_step_failures) from exc
        error = JobError(type="InternalError", message=f"the engine failed while running this job: {message}")
        for job_id in job_ids:
            self.finish.end_dropped(self.held.drop(job_id), JobStatus.FAILED, error)

    # -- housekeeping ------------------------------------------------------------------------

    def _housekeeping(self) -> None:
        now = time.time()
        for held in [h for h in self.held if h.deadline is not None and now >= h.deadline]:
            limit = min(t for t in (held.job.timeout_s, held.lease.time_limit_s) if t is not None)
            error = JobError(type="Timeout", message=f"job ran past its time limit of {limit}s")
            self.finish.end_dropped(self.held.drop(held.job.id), JobStatus.TIMEOUT, error)
        if not self.broker.may_try():
            return
        if self.held and self._timers.due("cancel"):
            held_ids = self.held.ids()
            cancelled = self.broker.fetch(
                "reading cancel flags",
                lambda: self.sink.cancelled_ids(held_ids) | self.source.revoked_ids(held_ids),
            )
            if cancelled is None:
                return
            for job_id in cancelled:
                self.finish.end_dropped(self.held.drop(job_id), JobStatus.CANCELLED, None)
        if self.held and self._timers.due("extend"):
            leases = leases_of(self.held)
            lost_leases = self.broker.fetch("extending leases", lambda: self.source.extend(leases))
            if lost_leases is None:
                return
            self._lease_keeper.mark_extended()
            self._drop_lost(lost_leases)
        if self._timers.due("stats"):
            self._write_stats(self.admission_stats())

    def _drop_lost(self, lost_leases: list[Lease]) -> None:
        if not lost_leases:
            return
        lost = {le.message_id for le in lost_leases}
        for held in [h for h in self.held if h.lease.message_id in lost]:
            # A peer owns the message now and will run it; running it too would only waste work.
            logger.warning("job %s: lease lost to a peer; dropping it here", held.job.id)
            self.held.drop(held.job.id)
            self.stats.num_leases_lost += 1
            self.metrics.observe_lease_lost()

    def _write_stats(self, admission: AdmissionStats) -> None:
        logger.debug(
            "worker %s: %d held (%d not started), %d free blocks, %d reserved, %d committed",
            self.name, admission.num_jobs_held, admission.num_jobs_not_started, admission.num_free_blocks,
            admission.num_reserved_blocks, admission.num_committed_blocks,
        )  # fmt: skip
        self.stats.num_broker_outages = self.outage.num_outages
        self.stats.num_deltas_dropped = self.outbox.num_deltas_dropped
        self._report.fill(self.stats, admission, self.engine, self.metrics.registry)
        self.metrics.observe_adapter_loads(self.stats.num_adapter_loads, self.stats.num_adapter_slot_loads)
        self.broker.make("writing worker stats", lambda: self.sink.write_worker_stats(self.name, self.stats))
        self.metrics.set_admission_gauges(self.engine.kv_stats(), admission)

    # -- broker outages ----------------------------------------------------------------------

    def _on_broker_recovered(self) -> None:
        self.stats.num_broker_outages = self.outage.num_outages
        # Check the leases now: a peer may have reclaimed a job while the broker was away, or
        # the broker restarted without the stream.
        self._timers.make_due("extend")

    def _give_up(self, reason: str) -> None:
        """The outage lasted the limit: free the engine, try once to release the held jobs (their
        leases expire otherwise), and let the error end the worker."""
        logger.error("worker %s gives up: %s", self.name, reason)
        dropped = self.held.drop_all()
        leases = leases_of(dropped)
        try:
            self.source.release(leases)
        except Exception:
            logger.info("worker %s: could not release %d jobs; their leases expire", self.name, len(leases))
        logger.error(
            "worker %s stopped after a broker outage: %d jobs held, %d results not stored: %s",
            self.name, len(dropped), self.outbox.num_unstored_results, self.stats,
        )  # fmt: skip

    # -- drain -------------------------------------------------------------------------------

    def _drain_tick(self) -> None:
        """Release every held job that cannot finish before the grace period ends."""
        to_release = self.drain.jobs_to_release(self.held, self._step_seconds)
        if to_release:
            note = f"attempt released by worker {self.name} during a drain (SIGTERM)"
            self.finish.release([self.held.drop(h.job.id) for h in to_release], note)
