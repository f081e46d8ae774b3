"""Pool mode: each row becomes a job on a queue that qworker workers serve; the results are
collected from the result store.

A row's job id is derived from the batch id and its custom_id (rows.request_id_for), and the ids
sent are recorded once the queue took them, in the result store beside the results
(submitted.py), so that every runner of the batch sees the record: a rerun on another machine, or
a gateway replica carrying on a batch that another started. A run enqueues only rows that no run
has enqueued and whose results are not in the store (finished rows put on the queue again would
count toward the queue depth that autoscalers read). It collects the rest from the store,
including rows that finished while no runner was there; rows whose results were stored before
this run are counted as collected, not as generated. The one gap: a runner killed after the
queue took a send and before the record holds it enqueues those rows again on the rerun; a
worker that takes the second message after the first one's result is stored acks it without
running it.

A runner can be told to stop (`should_stop`, checked between sweeps): the gateway stops a batch
that is cancelled, expired, or whose lease this replica lost; the rows still pending are then
`pending_ids()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import ValidationError

from qworker.engine.outputs import CompletionOutput
from qworker.jobs.client import Client
from qworker.jobs.job import (
    ChatMessage,
    Job,
    JobResult,
    JobStatus,
    ToolDefinition,
    format_validation_error,
    logprobs_dict,
)
from qworker.jobs.pooling_job import AnyJob
from qworker.openai.batches.output import BatchOutput
from qworker.openai.batches.progress import Progress
from qworker.openai.batches.submitted import SubmittedJournal, SubmittedRecord  # noqa: F401 - SubmittedJournal: its old home
from qworker.openai.bodies import Generation, response_body
from qworker.openai.format import BatchOutputLine, RowError, error_line, success_line
from qworker.openai.pooling_rows import BatchRow, EmbeddingRow, embedding_line
from qworker.openai.rows import RowFailure, RowRequest

logger = logging.getLogger(__name__)

# Jobs per send (one round trip on Redis, batches of 10 on SQS).
SEND_CHUNK = 64
# Sweeps of the pending results: at least this far apart, and up to the longer gap while none
# arrive. Each sweep reads every pending id once.
MIN_POLL_S = 0.2
MAX_POLL_S = 1.0
# Chat rows without a limit, when --max-model-len does not give the workers' context.
DEFAULT_POOL_MAX_TOKENS = 4096

# A failed job's error type -> (HTTP status, OpenAI error code) of its line. Other types: 500.
ERROR_STATUS = {
    "PromptTooLongError": (400, "context_length_exceeded"),
    "InvalidParamsError": (400, "invalid_request_error"),
    "StructuredOutputError": (400, "invalid_request_error"),
    "InvalidRequestError": (400, "invalid_request_error"),
    # A task the worker's model cannot do (a generation model asked to embed, or the reverse).
    "UnsupportedTaskError": (400, "invalid_request_error"),
    "ValidationError": (400, "invalid_request_error"),
    "InvalidJSON": (400, "invalid_request_error"),
    "JobTooLarge": (413, "request_too_large"),
    "Expired": (408, "expired"),
}


def job_for(row: RowRequest, default_max_tokens: int) -> Job:
    """The row as a job; RowError when the job schema refuses it."""
    try:
        params = row.sampling_params(row.max_tokens or default_max_tokens)
        common: dict[str, Any] = {
            "id": row.request_id,
            "params": params,
            "metadata": {"custom_id": row.custom_id},
            "affinity": row.affinity,
            "lora": row.lora,
        }
        if row.messages is not None:
            return Job(
                messages=[ChatMessage(**m) for m in row.messages],
                tools=[ToolDefinition.model_validate(t) for t in row.tools] if row.tools else None,
                chat_template_kwargs=row.chat_template_kwargs,
                **common,
            )
        if isinstance(row.prompt, str):
            return Job(prompt=row.prompt, **common)
        return Job(prompt_token_ids=row.prompt, **common)
    except ValidationError as exc:
        raise RowError(format_validation_error(exc)) from None


def generation_from_result(result: JobResult) -> Generation:
    """A completed job's output as a Generation: its n completions (`outputs`, or the top-level
    fields for one), with logprobs and prompt logprobs back in the engine's shape."""
    if result.outputs is not None:
        completions = [
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                finish_reason=c.finish_reason,
                logprobs=[logprobs_dict(p) for p in c.logprobs] if c.logprobs is not None else None,
            )
            for c in result.outputs
        ]
    else:
        completions = [
            CompletionOutput(
                index=0,
                text=result.text,
                token_ids=list(result.token_ids),
                finish_reason=result.finish_reason,
                logprobs=[logprobs_dict(p) for p in result.logprobs] if result.logprobs is not None else None,
            )
        ]
    prompt_logprobs = None
    if result.prompt_logprobs is not None:
        prompt_logprobs = [logprobs_dict(p) if p is not None else None for p in result.prompt_logprobs]
    return Generation(
        num_prompt_tokens=result.usage.prompt_tokens,
        completions=sorted(completions, key=lambda c: c.index),
        prompt_token_ids=result.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=result.usage.prompt_tokens_details.cached_tokens,
    )


def error_of_result(result: JobResult) -> RowError:
    if result.status is JobStatus.TIMEOUT:
        return RowError(_message(result, "the job ran past its timeout"), status_code=408, code="timeout")
    if result.status is JobStatus.CANCELLED:
        return RowError(_message(result, "the job was cancelled"), status_code=499, code="cancelled")
    error_type = result.error.type if result.error is not None else "Failed"
    status_code, code = ERROR_STATUS.get(error_type, (500, "server_error"))
    return RowError(_message(result, "the job failed"), status_code=status_code, code=code)


def _message(result: JobResult, default: str) -> str:
    if result.error is None:
        return default
    return f"{result.error.type}: {result.error.message}"


def line_of_result(row: BatchRow, result: JobResult) -> tuple[BatchOutputLine, int, int]:
    """The row's output line, and its prompt and completion token counts."""
    try:
        if result.status is not JobStatus.COMPLETED:
            raise error_of_result(result)
        created = int(result.timings.finished_at or time.time())
        if isinstance(row, EmbeddingRow):
            line, num_prompt_tokens = embedding_line(row, result, created)
            return line, num_prompt_tokens, 0
        body = response_body(row, generation_from_result(result), created)
    except RowError as exc:
        return error_line(row.custom_id, row.request_id, exc), 0, 0
    line = success_line(row.custom_id, row.request_id, body)
    return line, body.usage.prompt_tokens, body.usage.completion_tokens


class PoolRunner:
    """Enqueues the rows through `client` and writes each result's line to `output` as it arrives.
    At most `max_pending` rows are enqueued and not yet collected."""

    def __init__(
        self,
        client: Client,
        output: BatchOutput,
        progress: Progress,
        journal: SubmittedRecord,
        *,
        default_max_tokens: int = DEFAULT_POOL_MAX_TOKENS,
        max_pending: int = 10_000,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        assert max_pending >= 1, f"max_pending must be >= 1, got {max_pending}"
        self.client = client
        self.output = output
        self.progress = progress
        self.journal = journal
        self.default_max_tokens = default_max_tokens
        self.max_pending = max_pending
        self.should_stop = should_stop
        # Set when should_stop ended the run early: the rows in pending_ids() have no line.
        self.is_stopped = False
        self._pending: dict[str, BatchRow] = {}
        self._to_send: list[AnyJob] = []
        # Rows whose results were in the store before this run sent anything for them.
        self._collected: set[str] = set()
        self._poll_s = MIN_POLL_S
        self.num_enqueued = 0

    def pending_ids(self) -> list[str]:
        """Job ids enqueued (or about to be) whose lines are not written yet."""
        return list(self._pending)

    def _stopping(self) -> bool:
        if self.should_stop is not None and self.should_stop():
            self.is_stopped = True
        return self.is_stopped

    def run(self, rows: Iterable[BatchRow | RowFailure]) -> None:
        self.progress.start()
        for item in rows:
            if self._stopping():
                return
            if isinstance(item, RowFailure):
                self._write(error_line(item.custom_id, item.request_id, item.error), item.error.status_code)
                continue
            if item.request_id not in self.journal:
                try:
                    if isinstance(item, EmbeddingRow):
                        self._to_send.append(item.job)
                    else:
                        self._to_send.append(job_for(item, self.default_max_tokens))
                except RowError as exc:
                    self._write(error_line(item.custom_id, item.request_id, exc), exc.status_code)
                    continue
                if len(self._to_send) >= SEND_CHUNK:
                    self._send()
            elif self.client.sink.has_result(item.request_id):
                self._collected.add(item.request_id)
            self._pending[item.request_id] = item
            while len(self._pending) >= self.max_pending:
                self._send()
                self._wait_and_collect()
                if self._stopping():
                    return
        self._send()
        while self._pending:
            if self._stopping():
                return
            self._wait_and_collect()

    def _send(self) -> None:
        if not self._to_send:
            return
        stored = {
            job.id for job in self._to_send if job.id is not None and self.client.sink.has_result(job.id)
        }
        self._collected |= stored
        to_send = [job for job in self._to_send if job.id not in stored]
        self._to_send = []
        if not to_send:
            return
        job_ids = self.client.submit_many(to_send)
        self.journal.add(job_ids)
        self.num_enqueued += len(job_ids)

    def _wait_and_collect(self) -> None:
        time.sleep(self._poll_s)
        num_found = 0
        for request_id in list(self._pending):
            result = self.client.sink.get_result(request_id)
            if result is None:
                continue
            row = self._pending.pop(request_id)
            line, num_prompt, num_completion = line_of_result(row, result)
            status_code = line.response.status_code if line.response else 500
            if request_id in self._collected:
                self.output.write(line)
                self.progress.row_done(status_code, collected=True)
            else:
                self._write(line, status_code, num_prompt, num_completion)
            num_found += 1
        self._poll_s = MIN_POLL_S if num_found else min(MAX_POLL_S, self._poll_s * 1.5)
        self.progress.tick()

    def _write(
        self, line: BatchOutputLine, status_code: int, num_prompt: int = 0, num_completion: int = 0
    ) -> None:
        self.output.write(line)
        self.progress.row_done(status_code, num_prompt, num_completion)
