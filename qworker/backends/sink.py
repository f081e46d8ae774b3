"""The result-store interface: where the worker writes streamed deltas and final results, and
the notes kept beside them.

The store keeps exactly one result per job id: `write_result` stores only when none exists
and says whether it stored. The read side (`get_result`, `read_deltas`) lives on the same
store, because the client reads what the worker writes there.

Cancel flags, last errors and worker stats are not results: they are `JobNotes`, what clients
and workers tell each other about jobs. Each result store keeps them too (in Redis, under the
same prefix), and a split store (split_sink.py) sends them to its streaming side.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from qworker.jobs.job import JobResult


@dataclass
class Delta:
    """New output of one job since its last delta, or the marker that opens a new attempt."""

    job_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    # Set on the marker a worker writes before a job's second or later attempt streams (the
    # attempt number: the message's delivery count). A marker has no text and no tokens; a
    # reader drops what earlier attempts streamed, because the new attempt streams from the start
    # (or, with `resume`, keeps its first characters: the new attempt continues them).
    attempt: int | None = None
    # The position of this delta's first token in the job's output (0 for the first token), so
    # that a resuming worker never stitches tokens across a gap (deltas the outbox dropped, a
    # trimmed stream). None from writers that do not say.
    pos: int | None = None
    # On an attempt marker: the new attempt continues from the earlier attempts' first
    # `resume.num_tokens` tokens and `resume.num_chars` characters of text; None: from zero.
    resume: ResumePoint | None = None


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed attempt continues: after this many output tokens, whose streamed text is
    this many characters (Unicode code points) long."""

    num_tokens: int
    num_chars: int


@dataclass(frozen=True)
class Progress:
    """What a job's earlier attempts generated, as its delta stream holds it: its first output
    tokens, contiguous from the first, and the text streamed for them (`progress_of`). With a
    `problem`, the stream cannot be trusted and the job starts from zero."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    problem: str | None = None


def progress_of(deltas: list[Delta]) -> Progress:
    """The tokens and text a job's deltas hold, attempt by attempt: a plain marker starts from
    zero, a resume marker keeps its first tokens and characters, and each delta extends them
    when it starts at their end (`pos`). A delta that starts before it (a stale writer's) is
    skipped; one after it (a gap), or one with text and no tokens (an attempt's last flush), ends
    what the attempt can add. Entries that are not what a worker writes make a `problem`."""
    token_ids: list[int] = []
    text = ""
    is_open = True  # whether this attempt's deltas may still extend the tokens
    for delta in deltas:
        if delta.attempt is not None:
            if delta.resume is None:
                token_ids, text = [], ""
            else:
                point = delta.resume
                if point.num_tokens > len(token_ids) or point.num_chars > len(text):
                    return Progress(problem=f"attempt {delta.attempt} resumes past what the stream holds")
                token_ids, text = token_ids[: point.num_tokens], text[: point.num_chars]
            is_open = True
            continue
        ids = delta.token_ids
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            return Progress(problem=f"a delta's token ids are not a list of ints: {str(ids)[:80]}")
        if not isinstance(delta.text, str):
            return Progress(problem="a delta's text is not text")
        if not is_open or delta.pos is None:
            is_open = False
            continue
        if not ids:
            is_open = is_open and not delta.text
            continue
        if delta.pos < len(token_ids):
            continue
        if delta.pos > len(token_ids):
            is_open = False
            continue
        token_ids.extend(ids)
        text += delta.text
    return Progress(token_ids, text)


def latest_attempt(deltas: list[Delta]) -> list[Delta]:
    """`deltas` from their last marker of an attempt that streams from the start on (all of them
    when there is none): what a reader that has not yet yielded any of them should see. Resume
    markers stay in the list; a reader applies them as they come (Client.stream)."""
    for i in range(len(deltas) - 1, -1, -1):
        if deltas[i].attempt is not None and deltas[i].resume is None:
            return deltas[i:]
    return deltas


def wait_for_result(sink: ResultSink, job_id: str, timeout_s: float | None) -> Iterator[Delta]:
    """`read_deltas` for a store that keeps only final results: no deltas, returns once the result
    exists. Raises TimeoutError after `timeout_s`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    wait_s = 0.02
    while not sink.has_result(job_id):
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no result for job {job_id} within {timeout_s}s")
        time.sleep(wait_s)
        wait_s = min(0.5, wait_s * 1.5)
    return
    yield  # a generator, like every read_deltas


class JobNotes(abc.ABC):
    """Cancel flags (client -> worker), last errors (one attempt -> the next) and worker stats
    (worker -> operators and the pool-demand exporter)."""

    @abc.abstractmethod
    def request_cancel(self, job_id: str) -> None: ...

    @abc.abstractmethod
    def cancelled_ids(self, job_ids: list[str]) -> set[str]:
        """The ids among `job_ids` whose cancellation was requested."""

    def write_last_errors(self, job_id_to_error: dict[str, str]) -> None:  # noqa: B027 - optional hook
        """Keep, per job id, what went wrong in its latest attempt (or, written as an attempt
        begins, what would explain it never ending: the worker died). The attempt after it reads
        this back when it dead-letters the job, so that the reason names the real error. Kept for
        a day; a store without a place for it forgets."""

    def last_error(self, job_id: str) -> str | None:
        """What write_last_errors kept for the job, or None."""
        return None

    def write_worker_stats(self, worker_name: str, stats: Any) -> None:  # noqa: B027 - optional hook
        """Publish a worker's stats (a dataclass) for operators; a store may ignore them."""


class ResultSink(JobNotes):
    """A result store, with the job notes kept beside its results."""

    @abc.abstractmethod
    def write_deltas(self, deltas: list[Delta]) -> None:
        """Append each delta to its job's live stream (one round trip for a whole engine step)."""

    @abc.abstractmethod
    def write_result(self, result: JobResult) -> bool:
        """Store the final result unless one exists. True if this call stored it."""

    @abc.abstractmethod
    def has_result(self, job_id: str) -> bool: ...

    @abc.abstractmethod
    def get_result(self, job_id: str) -> JobResult | None: ...

    @abc.abstractmethod
    def read_deltas(self, job_id: str, timeout_s: float | None) -> Iterator[Delta]:
        """Yield the job's deltas from the start until its result is written.

        Raises TimeoutError when nothing new arrives within `timeout_s`.
        """

    def end_deltas(self, job_id: str, status: str) -> None:
        """End the job's live stream (its result is stored, here or in another store): a reader
        of `read_deltas` stops. A store that streams deltas must implement it."""

    def read_progress(self, job_id: str) -> Progress | None:
        """What the job's earlier attempts generated (progress_of over its deltas), for a new
        attempt to continue from; None from a store that keeps no deltas (its jobs start from
        zero)."""
        return None

    @abc.abstractmethod
    def delete_result(self, job_id: str) -> None:
        """Remove the job's result, its deltas and its last error (replaying a dead letter,
        dead_letters.clear_failed_result, is the one caller)."""

    def close(self) -> None:
        """Release network resources."""
