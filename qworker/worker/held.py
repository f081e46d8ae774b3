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
from qworker.worker.admission import HeldJobSize
from qworker.worker.engine_protocol import EngineProtocol

logger = logging.getLogger(__name__)


@dataclass
class HeldJob:
    """A job this worker holds a lease on and has handed to the engine."""

    job: Job
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

    @property
    def leases(self) -> list[Lease]:
        return [self.lease, *self.extra_leases]


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

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._by_id

    def __iter__(self) -> Iterator[HeldJob]:
        return iter(list(self._by_id.values()))

    def get(self, job_id: str) -> HeldJob | None:
        return self._by_id.get(job_id)

    def ids(self) -> list[str]:
        return list(self._by_id)

    def add(self, held: HeldJob) -> None:
        """Hold a job whose request the engine has just taken (add_request succeeded)."""
        assert held.job.id not in self._by_id, f"job {held.job.id} is held already"
        self._by_id[held.job.id] = held

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
        return self._by_id.pop(job_id)

    def drop(self, job_id: str) -> DroppedJob:
        """Stop the job in the engine (its blocks are freed) and stop holding it."""
        held = self._by_id.pop(job_id)
        try:
            output = self._engine.abort(job_id)
        except Exception:
            # The job ends here whatever the engine says: its leases go back to the caller.
            logger.debug("job %s: abort failed", job_id, exc_info=True)
            output = None
        return DroppedJob(held, output)

    def drop_all(self) -> list[DroppedJob]:
        return [self.drop(job_id) for job_id in list(self._by_id)]

    def sizes(self) -> list[HeldJobSize]:
        """What admission needs to know of each held job."""
        return [
            HeldJobSize(
                # A resumed job prefills its resumed tokens with the prompt, and grows by the rest.
                h.num_prompt_tokens + h.num_resumed_tokens,
                # n completions each grow to max_tokens (only completion 0's tokens are streamed
                # and counted, so this errs on the side of more blocks).
                h.job.params.max_tokens * h.job.params.n - h.num_resumed_tokens,
                h.num_output_tokens,
                h.num_output_tokens > 0,
                0 if h.num_output_tokens else self._engine.num_cached_prefix_tokens(h.job.id),
            )
            for h in self._by_id.values()
        ]
