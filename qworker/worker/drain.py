"""The drain after SIGTERM: stop pulling, let the jobs that can finish within the grace period
finish, and release the rest at once so that peers take them instead of waiting out a lease."""

from __future__ import annotations

import logging
import time

from qworker.jobs.job import Job
from qworker.worker.held import HeldJob, HeldJobs

logger = logging.getLogger(__name__)


class Drain:
    """One worker's drain: begun once, then ticked every iteration until nothing is held."""

    def __init__(self, worker_name: str, grace_s: float) -> None:
        self.worker_name = worker_name
        self.grace_s = grace_s
        self.deadline: float | None = None

    @property
    def is_draining(self) -> bool:
        return self.deadline is not None

    def begin(self, num_held: int) -> None:
        self.deadline = time.monotonic() + self.grace_s
        logger.info("worker %s draining: %d jobs held, grace %.1fs", self.worker_name, num_held, self.grace_s)

    def jobs_to_release(self, held: HeldJobs, step_seconds: float) -> list[HeldJob]:
        """The held jobs that cannot finish before the grace period ends, at `step_seconds` a step."""
        assert self.deadline is not None, "the drain has begun"
        # Keep a margin for releasing and exiting.
        time_left = self.deadline - time.monotonic() - max(0.5, 3 * step_seconds)
        return [h for h in held if not can_finish(h, time_left, step_seconds)]


def can_finish(held: HeldJob, time_left: float, step_seconds: float) -> bool:
    if held.fan_in is not None:
        # A pooling job is prefill only: one that has begun ends within a step or two.
        return bool(held.fan_in.outputs) and 2 * step_seconds <= time_left
    assert isinstance(held.job, Job), "a held job without a fan-in is a generation job"
    if held.num_output_tokens == 0:
        return False  # not started: a peer can start it as soon as we could
    steps_left = held.job.params.max_tokens - held.num_resumed_tokens - held.num_output_tokens
    return steps_left * step_seconds <= time_left
