"""The one end path of a message: whatever ends a job goes through here, into the outbox (deltas,
then the result, then the ack or dead letter, outbox.py), or back to the queue for a peer.

- `end`: a job with a result (completed, failed, timed out, cancelled): the result is stored,
  and only then are its leases acked.
- `dead_letter`: a message that must not run again: its failed result, when the job has an id,
  is stored first (a client waiting on the id hears why), then the message moves.
- `ack_done`: a redelivery of a job whose result is stored already: acked without running.
- `release`: jobs handed back unfinished (a drain, a broken engine): noted, then released.

Counters follow each result's status through a table (stats.RESULT_COUNTERS).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from qworker.backends.sink import ResultSink
from qworker.backends.source import JobSource, Lease
from qworker.engine.outputs import RequestOutput
from qworker.jobs.job import Job, JobError, JobResult, JobStatus
from qworker.worker.broker_calls import BrokerCalls
from qworker.worker.held import DroppedJob, HeldJob, leases_of
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outbox import Outbox, PendingFinal
from qworker.worker.results import build_result
from qworker.worker.stats import WorkerStats

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Finisher:
    worker_name: str
    outbox: Outbox
    sink: ResultSink
    source: JobSource
    broker: BrokerCalls
    stats: WorkerStats
    metrics: WorkerMetrics
    log_payloads: bool

    def end(self, result: JobResult, leases: list[Lease]) -> None:
        """Store the result, then ack every lease."""
        if self.log_payloads:
            logger.debug("job %s result (%s): %r", result.id, result.status.value, result.text)
        self._send(PendingFinal(result, list(leases)))
        self.stats.count_result(result.status)

    def end_held(
        self, held: HeldJob, output: RequestOutput | None, status: JobStatus, error: JobError | None
    ) -> None:
        """End a job that ran (the engine finished it, or it was dropped: see held.py). An output
        the engine failed on its own (a grammar that did not compile) makes a failed result."""
        if output is not None:
            self.metrics.observe_preemptions(output.num_preemptions)
            if output.error is not None and status is JobStatus.COMPLETED:
                status = JobStatus.FAILED
                error = JobError(type=output.error.type, message=output.error.message)
        result = build_result(held.job.id, held.job, held.lease, status, error, output, self.worker_name)
        # The step loop counted completion 0's tokens as they came; the other completions of an
        # n > 1 job stream nowhere, so their tokens count now.
        self.metrics.observe_generated_tokens(max(0, result.usage.completion_tokens - held.num_output_tokens))
        self.end(result, held.leases)

    def end_dropped(self, dropped: DroppedJob, status: JobStatus, error: JobError | None) -> None:
        self.end_held(dropped.held, dropped.output, status, error)

    def end_unstarted(
        self, lease: Lease, job_id: str, job: Job | None, status: JobStatus, error: JobError | None
    ) -> None:
        """End a job that never reached the engine (bad input, expired, cancelled while queued)."""
        if status is JobStatus.FAILED and error is not None:
            # The message may quote the input (a validation error shows the offending value).
            if self.log_payloads:
                logger.info("job %s failed: %s: %s", job_id, error.type, error.message[:200])
            else:
                logger.info("job %s failed: %s", job_id, error.type)
        self.end(build_result(job_id, job, lease, status, error, None, self.worker_name), [lease])

    def dead_letter(self, lease: Lease, kind: str, reason: str, job_id: str | None) -> None:
        """`kind`: a short fixed name (the metric's label), `reason`: the words for people. With a
        `job_id`, a failed result saying why is stored first, so that a client waiting on the job
        hears it."""
        result = None
        if job_id is not None:
            error = JobError(type=kind, message=reason)
            result = build_result(job_id, None, lease, JobStatus.FAILED, error, None, self.worker_name)
        logger.warning("message %s dead-lettered: %s", lease.message_id, reason)
        self._send(PendingFinal(result, [lease], dead_letter=(kind, reason)))
        self.stats.num_dead_lettered += 1
        self.metrics.observe_dead_letter(kind)

    def ack_done(self, lease: Lease) -> None:
        """A redelivery whose result is stored: ack it, with nothing to store."""
        self.stats.num_skipped_done += 1
        self._send(PendingFinal(None, [lease]))

    def join_pending(self, final: PendingFinal, lease: Lease) -> None:
        """A redelivery whose result waits in the outbox (the broker was away): acked with it."""
        if all(le.message_id != lease.message_id for le in final.leases):
            final.leases.append(lease)

    def release(self, jobs: list[DroppedJob], note: str) -> None:
        """Give unfinished jobs back to the queue at once for a peer, noting `note` as their last
        error. If the broker is away, their leases expire and peers take them all the same."""
        if not jobs:
            return
        self.broker.make(
            "noting the release", lambda: self.sink.write_last_errors({j.held.job.id: note for j in jobs})
        )
        leases = leases_of(jobs)
        self.broker.make("releasing jobs", lambda: self.source.release(leases))
        self.stats.num_released += len(jobs)
        self.metrics.observe_released(len(jobs))
        logger.info("worker %s released %d jobs to its peers", self.worker_name, len(jobs))

    def flush(self) -> None:
        """Write what waits (outbox.py); a broker error stops it and counts toward the outage
        (the next try is on its backoff)."""
        if self.outbox.is_empty:
            return
        self.broker.make(
            "writing results", lambda: self.outbox.flush(self.sink, self.source, self._on_stored)
        )

    def _send(self, final: PendingFinal) -> None:
        self.outbox.add_final(final)
        self.flush()

    def _on_stored(self, result: JobResult, is_new: bool) -> None:
        if is_new:
            self.metrics.observe_result(result)
        else:
            logger.info("job %s already had a result; keeping that one", result.id)
