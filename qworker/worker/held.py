"""The jobs a worker holds: each has a lease (or several, for a producer's duplicates) and a
request in the engine.

Removal keeps the two together: `drop` always aborts the engine request (freeing its KV blocks)
and hands back the job with every lease it held, so that whatever ends the job next (a result,
a release, nothing for a lost lease) has them all. A job the engine finished itself leaves through
`pop_finished`, without an abort. This is the one place the worker calls `engine.abort`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from qworker.backends.source import Lease
from qworker.engine.outputs import RequestOutput
from qworker.jobs.job import Job
from qworker.jobs.pooling_job import AnyJob
from qworker.worker.admission import HeldJobSize, PoolingJobSize
from qworker.worker.engine_protocol import EngineProtocol
from qworker.worker.pooling import PoolingFanIn

logger = logging.getLogger(__name__)


@dataclass
class HeldJob:
    """A job this worker holds a lease on and has handed to the engine: a generation job is one
    request under its job id; a pooling job is one request per input (`fan_in`)."""

    job: AnyJob
    lease: Lease
    num_prompt_tokens: int
    deadline: float | None
    # Tokens this attempt generated (its step outputs'), after the earlier attempts' it resumed
    # from (their output tokens, prefilled with the prompt: docs/queues.md "Resume from tokens").
    num_output_tokens: int = 0
    num_resumed_tokens: int = 0
    # time.monotonic() of its latest token: the start of the next inter-token gap.
    last_token_at: float | None = None
    # The same job id delivered again while it runs (a producer's duplicate): acked with it.
    extra_leases: list[Lease] = field(default_factory=list)
    # A pooling job's requests and their outputs so far.
    fan_in: PoolingFanIn | None = None

    @property
    def leases(self) -> list[Lease]:
        return [self.lease, *self.extra_leases]

    @property
    def request_ids(self) -> list[str]:
        """Its requests in the engine (a pooling job's unfinished ones)."""
        return self.fan_in.pending_request_ids if self.fan_in is not None else [self.job.id]


@dataclass
class DroppedJob:
    """A job taken out of the engine: what it had produced (None when the abort failed or the
    engine had nothing), and its leases, for the caller to end."""

    held: HeldJob
    output: RequestOutput | None

    @property
    def leases(self) -> list[Lease]:
        return self.held.leases


def leases_of(jobs: Iterable[HeldJob | DroppedJob]) -> list[Lease]:
    """Every lease of these jobs, the duplicates' too."""
    return [lease for job in jobs for lease in job.leases]


class HeldJobs:
    """Job id -> HeldJob, for the jobs in `engine`."""

    def __init__(self, engine: EngineProtocol) -> None:
        self._engine = engine
        self._by_id: dict[str, HeldJob] = {}
        # A pooling job's request ids -> its job id (a generation job's request id is its job id).
        self._job_of_request: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._by_id

    def __iter__(self) -> Iterator[HeldJob]:
        return iter(list(self._by_id.values()))

    def get(self, job_id: str) -> HeldJob | None:
        return self._by_id.get(job_id)

    def owner_of(self, request_id: str) -> HeldJob | None:
        """The held job an engine request belongs to."""
        return self._by_id.get(self._job_of_request.get(request_id, request_id))

    def ids(self) -> list[str]:
        return list(self._by_id)

    def add(self, held: HeldJob) -> None:
        """Hold a job whose request the engine has just taken (add_request succeeded)."""
        assert held.job.id not in self._by_id, f"job {held.job.id} is held already"
        self._by_id[held.job.id] = held
        if held.fan_in is not None:
            for request_id in held.fan_in.request_ids:
                self._job_of_request[request_id] = held.job.id

    def join(self, job_id: str, lease: Lease) -> None:
        """Another delivery of a held job: our own message again (its lease renewed by a claim)
        replaces the lease; a producer's duplicate is kept, to be acked with the job."""
        held = self._by_id[job_id]
        if lease.message_id == held.lease.message_id:
            held.lease = lease
        else:
            held.extra_leases.append(lease)

    def pop_finished(self, job_id: str) -> HeldJob:
        """A job the engine finished: it has left the engine already."""
        return self._forget(job_id)

    def _forget(self, job_id: str) -> HeldJob:
        held = self._by_id.pop(job_id)
        if held.fan_in is not None:
            for request_id in held.fan_in.request_ids:
                self._job_of_request.pop(request_id, None)
        return held

    def drop(self, job_id: str) -> DroppedJob:
        """Stop the job in the engine (its blocks are freed) and stop holding it."""
        held = self._forget(job_id)
        output = None
        for request_id in held.request_ids:
            try:
                aborted = self._engine.abort(request_id)
            except Exception:
                # The job ends here whatever the engine says: its leases go back to the caller.
                logger.debug("job %s: abort of %s failed", job_id, request_id, exc_info=True)
                continue
            if held.fan_in is None:
                # A generation job's partial output (a pooling job's partial vectors are its fan-in's).
                assert aborted is None or isinstance(aborted, RequestOutput), "a generation request's output"
                output = aborted
        return DroppedJob(held, output)

    def drop_all(self) -> list[DroppedJob]:
        return [self.drop(job_id) for job_id in list(self._by_id)]

    def sizes(self) -> list[HeldJobSize | PoolingJobSize]:
        """What admission needs to know of each held job."""
        return [self._size(h) for h in self._by_id.values()]

    def _size(self, h: HeldJob) -> HeldJobSize | PoolingJobSize:
        if h.fan_in is not None:
            # Prompt blocks only, for the inputs still to run: a pooling request never decodes,
            # and the engine frees its blocks right after its last chunk.
            pending = [n for i, n in enumerate(h.fan_in.num_tokens) if i not in h.fan_in.outputs]
            return PoolingJobSize(sum(pending), len(pending))
        assert isinstance(h.job, Job), "a held job without a fan-in is a generation job"
        return HeldJobSize(
            # A resumed job prefills its resumed tokens with the prompt, and grows by the rest.
            h.num_prompt_tokens + h.num_resumed_tokens,
            # n completions each grow to max_tokens (only completion 0's tokens are streamed
            # and counted, so this errs on the side of more blocks).
            h.job.params.max_tokens * h.job.params.n - h.num_resumed_tokens,
            h.num_output_tokens,
            h.num_output_tokens > 0,
            0 if h.num_output_tokens else self._engine.num_cached_prefix_tokens(h.job.id),
        )
