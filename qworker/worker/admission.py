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

Pooling jobs (embed, classify, score: docs/pooling.md) need their prompt blocks and nothing more:
no decode follows, and the engine frees the blocks after the prompt's last chunk. A held one
commits the blocks of its inputs still to run and reserves nothing. They are packed: while the
jobs a worker takes are mostly pooling ones (a running share of what it took), the backlog bound
becomes a token bound, so that the worker takes as many as fill `pooling_token_budget` tokens
(two steps' worth by default: the next step's inputs are at hand while this one's results are
written) and the KV headroom holds:

    pull = min(headroom // typical_prompt_blocks,
               (pooling_token_budget - pooling_tokens_held) // typical_pooling_tokens)

The worker sorts what it took by length before the engine sees it (take.py), so that a step's
chunks are of like lengths.
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
class PoolingJobSize:
    """A held pooling job: the tokens of its inputs still to run, and how many inputs they are."""

    num_prompt_tokens: int
    num_inputs: int


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
    # Tokens of pooling jobs held at once, while the jobs taken are mostly pooling ones (the
    # worker passes twice the engine's max_num_batched_tokens); 0: pooling jobs are not packed.
    pooling_token_budget: int = 0
    # Start at one block: the first pull is bounded by max_backlog anyway.
    typical_prompt_blocks: float = 1.0
    # A running mean of a pooling job's tokens, and of the share of pooling jobs among those taken.
    typical_pooling_tokens: float = 1.0
    pooling_share: float = 0.0

    def __post_init__(self) -> None:
        if self.max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1, got {self.max_backlog}")
        if self.reserve_blocks_per_seq < 0:
            raise ValueError(f"reserve_blocks_per_seq must be >= 0, got {self.reserve_blocks_per_seq}")

    def observe_prompt(self, num_prompt_tokens: int, num_shared_prefix_tokens: int = 0) -> None:
        blocks = cdiv(num_prompt_tokens + 1, self.block_size) - num_shared_prefix_tokens // self.block_size
        # An exponential mean: adapts when the workload changes, and is cheap.
        self.typical_prompt_blocks += 0.1 * (blocks - self.typical_prompt_blocks)
        self.pooling_share -= 0.1 * self.pooling_share

    def observe_pooling(self, num_prompt_tokens: int, num_inputs: int) -> None:
        """A pooling job taken: its inputs' tokens (after truncation)."""
        blocks = cdiv(num_prompt_tokens, self.block_size) + num_inputs
        self.typical_prompt_blocks += 0.1 * (blocks - self.typical_prompt_blocks)
        self.typical_pooling_tokens += 0.1 * (num_prompt_tokens - self.typical_pooling_tokens)
        self.pooling_share += 0.1 * (1.0 - self.pooling_share)

    @property
    def is_packing(self) -> bool:
        """Whether the jobs taken lately are mostly pooling ones: then the token bound applies."""
        return self.pooling_token_budget > 0 and self.pooling_share > 0.5

    def decide(
        self, num_total_blocks: int, num_free_blocks: int, jobs: list[HeldJobSize | PoolingJobSize]
    ) -> AdmissionStats:
        reserved = 0
        committed = 0
        num_not_started = 0
        demand = 0
        pooling_tokens = 0
        for job in jobs:
            if isinstance(job, PoolingJobSize):
                # Each input's last block may be partly empty: at most one block more per input.
                blocks = cdiv(job.num_prompt_tokens, self.block_size) + job.num_inputs
                committed += blocks
                demand += blocks
                pooling_tokens += job.num_prompt_tokens
                num_not_started += 1
                continue
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
        if self.is_packing:
            by_tokens = int(
                (self.pooling_token_budget - pooling_tokens) // max(1.0, self.typical_pooling_tokens)
            )
            if not jobs:
                by_tokens = max(1, by_tokens)  # a job larger than the budget still runs, alone
            to_pull = max(0, min(by_blocks, by_tokens))
        else:
            to_pull = max(
                0, min(self.max_backlog - num_not_started, by_blocks, self.max_jobs_held - len(jobs))
            )
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
