"""Intake: what to do with one leased message, decided from the lease and what is known about its
job. A pure function: it reads through `IntakeFacts` and writes nothing; the loop carries out the
Outcome (finish.py ends it, held.py holds it, or the engine takes it).

The checks run in this order, each before anything that would be wasted if it fails:

    no job id                 -> DeadLetter (no result: there is no id to store it under)
    the job is held here      -> JoinHeld   (our own entry again, or a producer's duplicate)
    its result waits / exists -> AckDone    (never run twice)
    refused by the source     -> DeadLetter (with a failed result)
    delivered > max_attempts  -> DeadLetter (before its body is read again)
    body is not a valid job   -> Fail
    waited past its ttl_s     -> Fail (Expired)
    past the message's expiry -> Cancel (Expired)
    cancelled or revoked      -> Cancel
    otherwise                 -> Run

Once a Run's prompt is prepared and handed to the engine, a failure there is mapped by
`start_failure`; an error nobody foresaw while taking a message, by `unforeseen_failure`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from qworker.backends.source import Lease
from qworker.errors import InvalidRequestError, PromptTooLongError
from qworker.jobs.job import Job, JobDecodeError, JobError
from qworker.jobs.pooling_job import AnyJob, decode_any_job
from qworker.worker.engine_protocol import EngineProtocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinHeld:
    job_id: str
    lease: Lease


@dataclass(frozen=True)
class AckDone:
    job_id: str
    lease: Lease
    # The result waits in the outbox (the broker was away), rather than in the store.
    is_result_pending: bool


@dataclass(frozen=True)
class DeadLetter:
    lease: Lease
    # A short fixed name (the metric's label) and the words for people.
    kind: str
    reason: str
    # When set, a failed result is stored under this id first.
    job_id: str | None


@dataclass(frozen=True)
class Fail:
    lease: Lease
    job_id: str
    job: AnyJob | None
    error: JobError


@dataclass(frozen=True)
class Cancel:
    lease: Lease
    job_id: str
    job: AnyJob
    error: JobError | None


@dataclass(frozen=True)
class Run:
    lease: Lease
    job_id: str
    job: AnyJob


Outcome = JoinHeld | AckDone | DeadLetter | Fail | Cancel | Run


class IntakeFacts(Protocol):
    """What the worker knows, or can read, about a job (each asked only when needed)."""

    def is_held(self, job_id: str) -> bool: ...

    def is_result_pending(self, job_id: str) -> bool: ...

    def has_result(self, job_id: str) -> bool: ...

    def last_error(self, job_id: str) -> str | None: ...

    def is_cancelled(self, job_id: str) -> bool: ...


def intake(lease: Lease, job_id: str | None, facts: IntakeFacts, *, max_attempts: int, now: float) -> Outcome:
    """The outcome of `lease`, whose job id the caller resolved (jobs.resolve_job_id)."""
    if job_id is None:
        reason = lease.rejection or "cannot read a job id: the body is not a JSON object and has no id field"
        return DeadLetter(lease, "Unreadable", reason, None)
    if facts.is_held(job_id):
        return JoinHeld(job_id, lease)
    if facts.is_result_pending(job_id):
        return AckDone(job_id, lease, is_result_pending=True)
    if facts.has_result(job_id):
        return AckDone(job_id, lease, is_result_pending=False)
    if lease.rejection is not None:
        return DeadLetter(lease, "Rejected", lease.rejection, job_id)
    # Before anything that reads the body: a message that broke every attempt so far is not
    # given another chance to.
    if lease.delivery_count > max_attempts:
        reason = f"delivered {lease.delivery_count} times; max_attempts is {max_attempts}"
        last_error = facts.last_error(job_id)
        if last_error:
            reason += f"; last error: {last_error}"
        return DeadLetter(lease, "DeadLettered", reason, job_id)
    try:
        job = decode_any_job(lease.body, job_id)
    except JobDecodeError as exc:
        return Fail(lease, job_id, None, JobError(type=exc.error_type, message=exc.message))
    if job.ttl_s is not None and lease.delivery_count == 1 and lease.enqueued_at is not None:
        waited = now - lease.enqueued_at
        if waited > job.ttl_s:
            message = f"waited {waited:.1f}s in the queue; ttl_s is {job.ttl_s}"
            return Fail(lease, job_id, job, JobError(type="Expired", message=message))
    if lease.expires_at is not None and now > lease.expires_at:
        message = f"the message expired {now - lease.expires_at:.1f}s before it was taken"
        return Cancel(lease, job_id, job, JobError(type="Expired", message=message))
    if facts.is_cancelled(job_id):
        return Cancel(lease, job_id, job, None)
    return Run(lease, job_id, job)


def prepare_prompt(engine: EngineProtocol, job: Job) -> dict[str, Any]:
    """The job's prompt as token ids (so that admission knows its size before the engine does)."""
    if job.prompt_token_ids is not None:
        return {"prompt_token_ids": list(job.prompt_token_ids)}
    if engine.tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids")
    if job.messages is not None:
        messages = [m.model_dump() for m in job.messages]
        return {
            "prompt_token_ids": engine.apply_chat_template(
                messages, tools=job.template_tools(), chat_template_kwargs=job.chat_template_kwargs
            )
        }
    assert job.prompt is not None, "Job validation guarantees one prompt form"
    text, token_ids = engine.tokenize(job.prompt)
    return {"prompt": text, "prompt_token_ids": token_ids}


def start_failure(run: Run, exc: Exception) -> Fail | DeadLetter:
    """The outcome of a Run whose prompt could not be prepared or that the engine refused."""
    if isinstance(exc, PromptTooLongError):
        # It may fit a worker with a longer context: kept in the dead-letter queue to replay.
        return DeadLetter(run.lease, type(exc).__name__, str(exc), run.job_id)
    if isinstance(exc, InvalidRequestError):
        return Fail(run.lease, run.job_id, run.job, JobError(type=type(exc).__name__, message=str(exc)))
    # A tokenizer or chat template that rejects this input.
    message = f"cannot prepare the prompt: {exc}"
    return Fail(run.lease, run.job_id, run.job, JobError(type="InvalidRequestError", message=message))


def unforeseen_failure(lease: Lease, job_id: str | None, exc: Exception) -> DeadLetter:
    """A message whose intake raised an error nobody foresaw: it is dead-lettered with the error
    (with a failed result when it has a job id), and the rest of the batch goes on."""
    reason = f"internal error while taking the job: {type(exc).__name__}: {exc}"
    return DeadLetter(lease, "InternalError", reason, job_id)
