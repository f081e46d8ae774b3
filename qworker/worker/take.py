"""Taking a leased message: intake (intake.py) decides its outcome, and this carries it out, so that
the message ends through finish.py or starts in the engine and joins the held set (held.py).

Only reads reach the broker before a job enters the engine (writes go to the outbox), so a
message whose taking failed part-way because the broker went away is taken again from the start.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from qworker.backends.sink import Delta, Progress, ResultSink, ResumePoint
from qworker.backends.source import JobSource, Lease
from qworker.engine.pooling_params import PoolingParams
from qworker.engine.resume import ResumeFrom
from qworker.errors import InvalidRequestError, ResumeRefusedError
from qworker.jobs.job import Job, JobStatus, resolve_job_id
from qworker.jobs.pooling_job import PoolingJob
from qworker.lora.adapter_list import AdapterList
from qworker.lora.request import LoRARequest
from qworker.worker import intake
from qworker.worker.admission import AdmissionPolicy
from qworker.worker.engine_protocol import EngineProtocol
from qworker.worker.finish import Finisher
from qworker.worker.held import HeldJob, HeldJobs
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outbox import Outbox
from qworker.worker.pooling import (
    PoolingFanIn,
    num_tokens_to_compute,
    pooling_params,
    pooling_prompts,
    request_id_of,
)
from qworker.worker.retry import BrokerOutageError, is_transient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _PooledRequest:
    """One input of a pooling job taken in this pull, not yet in the engine."""

    held: HeldJob
    request_id: str
    prompt: dict[str, Any]
    params: PoolingParams
    num_tokens: int
    arrival_time: float


@dataclass(kw_only=True)
class Taker:
    """Carries out intake's outcome for each leased message; also the IntakeFacts it reads."""

    worker_name: str
    engine: EngineProtocol
    source: JobSource
    sink: ResultSink
    held: HeldJobs
    outbox: Outbox
    finish: Finisher
    admission: AdmissionPolicy
    metrics: WorkerMetrics
    log_payloads: bool
    adapters: AdapterList = field(default_factory=AdapterList)
    # Written for each job as it enters the engine (one round trip per pull, pop_attempt_notes):
    # read back only if the attempt never ends here, to say why the job is later dead-lettered.
    _attempt_notes: dict[str, str] = field(default_factory=dict, init=False)
    # Pooling requests of the jobs taken in this pull, added to the engine together (sorted by
    # length) by add_pooled_requests.
    _pooled: list[_PooledRequest] = field(default_factory=list, init=False)

    def pop_attempt_notes(self) -> dict[str, str]:
        notes, self._attempt_notes = self._attempt_notes, {}
        return notes

    def take(self, lease: Lease, max_attempts: int) -> None:
        """Take one message. An error nobody foresaw is confined to it (intake.unforeseen_failure);
        a broker error is raised, and the message is taken again later."""
        job_id = resolve_job_id(lease.job_id, lease.body, self.source.queue_name, lease.message_id)
        try:
            self._apply(intake.intake(lease, job_id, self, max_attempts=max_attempts, now=time.time()))
        except Exception as exc:
            if is_transient(exc) or isinstance(exc, BrokerOutageError):
                raise  # the broker is away, not this message at fault: taken again later
            outcome = intake.unforeseen_failure(lease, job_id, exc)
            logger.error("message %s: %s", lease.message_id, outcome.reason)
            logger.debug("message %s: the error", lease.message_id, exc_info=True)
            try:
                held = self.held.get(job_id) if job_id is not None else None
                if held is not None and held.lease.message_id == lease.message_id:
                    self.held.drop(held.job.id)  # it got as far as the engine
                self._apply(outcome)
            except Exception:
                # Its lease expires and a later attempt, past max_attempts, dead-letters it first.
                logger.exception("message %s: cannot dead-letter it either", lease.message_id)

    # -- IntakeFacts -------------------------------------------------------------------------

    def is_held(self, job_id: str) -> bool:
        return job_id in self.held

    def is_result_pending(self, job_id: str) -> bool:
        return self.outbox.final_for(job_id) is not None

    def has_result(self, job_id: str) -> bool:
        return self.sink.has_result(job_id)

    def last_error(self, job_id: str) -> str | None:
        return self.sink.last_error(job_id)

    def is_cancelled(self, job_id: str) -> bool:
        return bool(self.sink.cancelled_ids([job_id]) or self.source.revoked_ids([job_id]))

    # -- outcomes ----------------------------------------------------------------------------

    def _apply(self, outcome: intake.Outcome) -> None:
        if isinstance(outcome, (intake.Fail, intake.Cancel, intake.Run)) and self.log_payloads:
            logger.debug("job %s payload: %r", outcome.job_id, outcome.lease.body)
        if isinstance(outcome, intake.JoinHeld):
            self.held.join(outcome.job_id, outcome.lease)
        elif isinstance(outcome, intake.AckDone):
            pending = self.outbox.final_for(outcome.job_id)
            if outcome.is_result_pending and pending is not None:
                self.finish.join_pending(pending, outcome.lease)
            else:
                self.finish.ack_done(outcome.lease)
        elif isinstance(outcome, intake.DeadLetter):
            self.finish.dead_letter(outcome.lease, outcome.kind, outcome.reason, outcome.job_id)
        elif isinstance(outcome, (intake.Fail, intake.Cancel)):
            status = JobStatus.FAILED if isinstance(outcome, intake.Fail) else JobStatus.CANCELLED
            self.finish.end_unstarted(outcome.lease, outcome.job_id, outcome.job, status, outcome.error)
        else:
            self._start(outcome)

    def _start(self, run: intake.Run) -> None:
        """Hand the job to the engine and hold it."""
        if isinstance(run.job, PoolingJob):
            self._start_pooling(run, run.job)
            return
        lease, job_id, job = run.lease, run.job_id, run.job
        now = time.time()
        # Earlier attempts' tokens (a released or killed worker's): a read, before the engine.
        progress = self.sink.read_progress(job_id) if lease.delivery_count > 1 else None
        resume_point: ResumePoint | None = None
        try:
            lora_request = self.adapters.resolve(job.lora) if job.lora is not None else None
            prompt = intake.prepare_prompt(self.engine, job)
            resume_point = self._add_request(
                job_id, job, prompt, lease.enqueued_at or now, progress, lora_request
            )
        except Exception as exc:
            if not isinstance(exc, InvalidRequestError):  # PromptTooLongError included
                # The traceback may quote the input: only with payload logging on.
                logger.warning("job %s: cannot prepare its prompt", job_id, exc_info=self.log_payloads)
            self._apply(intake.start_failure(run, exc))
            return
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        limits = [t for t in (job.timeout_s, lease.time_limit_s) if t is not None]
        deadline = now + min(limits) if limits else None
        num_resumed = resume_point.num_tokens if resume_point is not None else 0
        self.held.add(HeldJob(job, lease, num_prompt_tokens, deadline, num_resumed_tokens=num_resumed))
        self.metrics.observe_prompt_tokens(num_prompt_tokens)
        if lease.delivery_count > 1:
            # This attempt streams from the start, or from where it resumed: live readers drop
            # what earlier ones streamed, or keep that much of it.
            self.outbox.add_deltas([Delta(job_id, "", attempt=lease.delivery_count, resume=resume_point)])
        self._attempt_notes[job_id] = (
            f"attempt {lease.delivery_count} (worker {self.worker_name}, begun "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}) ended without a result: "
            "its worker was killed or crashed, or lost the job's lease"
        )
        self.admission.observe_prompt(num_prompt_tokens, self.engine.num_cached_prefix_tokens(job_id))

    def _start_pooling(self, run: intake.Run, job: PoolingJob) -> None:
        """Hold a pooling job and queue its inputs' requests for add_pooled_requests."""
        lease, job_id = run.lease, run.job_id
        now = time.time()
        try:
            prompts = pooling_prompts(self.engine, job)
            params = pooling_params(job)
        except Exception as exc:
            if not isinstance(exc, InvalidRequestError):  # UnsupportedTaskError included
                logger.warning("job %s: cannot prepare its inputs", job_id, exc_info=self.log_payloads)
            self._apply(intake.start_failure(run, exc))
            return
        num_tokens = [num_tokens_to_compute(p, job.truncate_prompt_tokens) for p in prompts]
        request_ids = [request_id_of(job_id, i) for i in range(len(prompts))]
        limits = [t for t in (job.timeout_s, lease.time_limit_s) if t is not None]
        deadline = now + min(limits) if limits else None
        fan_in = PoolingFanIn(request_ids, num_tokens, job.encoding_format)
        held = HeldJob(job, lease, sum(num_tokens), deadline, fan_in=fan_in)
        self.held.add(held)
        arrival_time = lease.enqueued_at or now
        self._pooled.extend(
            _PooledRequest(held, request_id, prompt, params, n, arrival_time)
            for request_id, prompt, n in zip(request_ids, prompts, num_tokens, strict=True)
        )
        self.metrics.observe_prompt_tokens(sum(num_tokens))
        self.admission.observe_pooling(sum(num_tokens), len(prompts))
        self._attempt_notes[job_id] = (
            f"attempt {lease.delivery_count} (worker {self.worker_name}) ended without a result: "
            "its worker was killed or crashed, or lost the job's lease"
        )

    def add_pooled_requests(self) -> None:
        """Hand this pull's pooling requests to the engine, shortest first, so that the
        scheduler's steps pack inputs of like lengths (its queue is first come, first served). A
        job whose input the engine refuses fails as a whole; its other requests are aborted."""
        pooled, self._pooled = self._pooled, []
        pooled.sort(key=lambda r: r.num_tokens)
        for request in pooled:
            held = request.held
            if self.held.get(held.job.id) is not held:
                continue  # failed on an earlier input (or dropped) already
            try:
                self.engine.add_request(
                    request.request_id,
                    request.prompt,
                    request.params,
                    priority=held.job.priority,
                    arrival_time=request.arrival_time,
                )
            except Exception as exc:
                if not isinstance(exc, InvalidRequestError):
                    logger.warning(
                        "job %s: the engine refused an input", held.job.id, exc_info=self.log_payloads
                    )
                self.held.drop(held.job.id)
                self._apply(intake.start_failure(intake.Run(held.lease, held.job.id, held.job), exc))

    def _add_request(
        self,
        job_id: str,
        job: Job,
        prompt: dict[str, Any],
        arrival_time: float,
        progress: Progress | None,
        lora_request: LoRARequest | None,
    ) -> ResumePoint | None:
        """Hand the job to the engine, resuming from `progress` when there is some and the engine
        can continue from it; else from zero, with a warning when stored tokens were refused.
        Where it resumed, or None."""
        if progress is not None and (progress.token_ids or progress.problem):
            problem = progress.problem
            if problem is None:
                resume = ResumeFrom(progress.token_ids, progress.text)
                try:
                    self.engine.add_request(
                        job_id,
                        prompt,
                        job.params,
                        priority=job.priority,
                        arrival_time=arrival_time,
                        resume=resume,
                        lora_request=lora_request,
                    )
                except ResumeRefusedError as exc:
                    problem = str(exc)
                else:
                    num_tokens = len(progress.token_ids)
                    logger.info("job %s resumes from %d stored tokens", job_id, num_tokens)
                    self.metrics.observe_resume(num_tokens)
                    return ResumePoint(num_tokens, len(progress.text))
            logger.warning(
                "job %s restarts from zero: its stored tokens cannot be resumed: %s", job_id, problem
            )
            self.metrics.observe_resume(None)
        self.engine.add_request(
            job_id,
            prompt,
            job.params,
            priority=job.priority,
            arrival_time=arrival_time,
            lora_request=lora_request,
        )
        return None
