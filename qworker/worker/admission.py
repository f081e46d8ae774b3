"""Admission control: how many new jobs the worker may take from the queue right now.

The rule, in blocks of the engine's paged KV cache:

    reserved  = sum over running jobs of min(reserve_blocks_per_seq, blocks still needed to max_tokens)
    committed = sum over jobs held but not started of
                ceil((prompt_tokens + 1) / block_size) - shared_prefix_tokens / block_size
    headroom  = free_blocks - reserved - committed
    pull      = min(max_backlog - jobs_not_started,      # the local backlog stays small
                    headroom // typical_prompt_blocks,   # only what can start soon
                    max_jobs_held - jobs_held)           # never more than the engine can batch

A job is "started" once the engine produced its first token. The prefix cache enters twice:
free_blocks counts cached blocks that no request holds (the engine evicts them when it needs
room), and a job's shared_prefix_tokens (the engine's `num_cached_prefix_tokens`) are the leading
prompt tokens in cached blocks that requests hold now, which the job will share instead of taking
free blocks. Cached blocks that nobody holds are not subtracted: reusing one takes it off the free
list, so it costs the job a free block like a new one. The typical prompt size is a running mean
of the blocks the jobs seen so far needed beyond their shared prefix. A job that turns out larger
than the headroom still waits in the engine, where it counts as committed, so no further job is
pulled until it fits. Hence the bound the tests check: jobs held <= jobs running + max_backlog,
and the running ones are those the KV cache holds. Everything else stays in the queue for other
workers.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class HeldJobSize:
    """What admission needs to know about one job the worker holds."""

    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int
    is_started: bool
    # Leading prompt tokens in cached blocks that requests hold now (whole blocks): the engine
    # shares them, so a job not started needs blocks only for the rest.
    num_shared_prefix_tokens: int = 0


@dataclass
class AdmissionStats:
    """The inputs and the outcome of one admission decision."""

    num_total_blocks: int
    num_free_blocks: int
    num_reserved_blocks: int
    num_committed_blocks: int
    num_headroom_blocks: int
    num_jobs_held: int
    num_jobs_not_started: int
    num_jobs_to_pull: int
    # Blocks the held jobs reach at max_tokens: what the pool-demand signal counts as running.
    num_demand_blocks: int


@dataclass
class AdmissionPolicy:
    # No defaults: the worker passes WorkerSettings' max_backlog and reserve_blocks_per_seq, the
    # single place where those defaults live.
    block_size: int
    max_backlog: int
    reserve_blocks_per_seq: int
    max_jobs_held: int
    # Start at one block: the first pull is bounded by max_backlog anyway.
    typical_prompt_blocks: float = 1.0

    def __post_init__(self) -> None:
        if self.max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {self.max_backlog}")
        if self.reserve_blocks_per_seq < 0:
            raise ValueError(f"reserve_blocks_per_seq must be >= 0, got {self.reserve_blocks_per_seq}")

    def observe_prompt(self, num_prompt_tokens: int, num_shared_prefix_tokens: int = 0) -> None:
        blocks = cdiv(num_prompt_tokens + 1, self.block_size) - num_shared_prefix_tokens // self.block_size
        # An exponential mean: adapts when the workload changes, and is cheap.
        self.typical_prompt_blocks += 0.1 * (blocks - self.typical_prompt_blocks)

    def decide(self, num_total_blocks: int, num_free_blocks: int, jobs: list[HeldJobSize]) -> AdmissionStats:
        reserved = 0
        committed = 0
        num_not_started = 0
        demand = 0
        for job in jobs:
            demand += cdiv(job.num_prompt_tokens + job.max_tokens, self.block_size)
            if job.is_started:
                num_tokens = job.num_prompt_tokens + job.num_output_tokens
                final_tokens = job.num_prompt_tokens + job.max_tokens
                still_needed = cdiv(final_tokens, self.block_size) - cdiv(num_tokens, self.block_size)
                reserved += min(self.reserve_blocks_per_seq, max(0, still_needed))
            else:
                committed += (
                    cdiv(job.num_prompt_tokens + 1, self.block_size)
                    - job.num_shared_prefix_tokens // self.block_size
                )
                num_not_started += 1
        headroom = num_free_blocks - reserved - committed
        by_blocks = int(headroom // max(1.0, self.typical_prompt_blocks)) if headroom > 0 else 0
        to_pull = max(0, min(self.max_backlog - num_not_started, by_blocks, self.max_jobs_held - len(jobs)))
        return AdmissionStats(
            num_total_blocks=num_total_blocks,
            num_free_blocks=num_free_blocks,
            num_reserved_blocks=reserved,
            num_committed_blocks=committed,
            num_headroom_blocks=headroom,
            num_jobs_held=len(jobs),
            num_jobs_not_started=num_not_started,
            num_jobs_to_pull=to_pull,
            num_demand_blocks=demand,
        )
