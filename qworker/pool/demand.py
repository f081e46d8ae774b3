"""Pool demand: the KV-cache blocks that a pool's waiting and running jobs need, and the number of
workers that serves them. Job counts are a poor signal for LLM work (ten 50-token jobs and ten
4,000-token jobs need very different pools); blocks are what a worker runs out of.

    job blocks      = ceil((prompt_tokens + max_tokens) / block_size), at least 1; a pooling job
                      (embed, classify, score: prefill only, never decoded) the sum over its
                      inputs of ceil(input_tokens / block_size), as the worker's admission counts it
    waiting demand  = sum of job blocks over the jobs no worker holds
    running demand  = sum over the jobs workers hold of the blocks they will reach: what they hold
                      now plus what they may still grow, up to max_tokens
    demand          = waiting demand + running demand
    capacity        = one worker's KV pool, in blocks (its num_kv_blocks): configured, or as the
                      live workers report it
    desired workers = 0 when nothing waits and nothing runs; else
                      max(1 if anything waits, ceil(demand / (capacity * target_utilization)))

A job's prompt tokens are exact when it carries prompt_token_ids; for text (prompt, messages)
before any tokenizer saw it, they are estimated from its length (`chars_per_token`). Where a job
cannot be read at all (an SQS message before it is received), it counts `mean_job_tokens`.
Where each term comes from, per queue, is in backlog.py.

Everything here is pure: numbers in, numbers out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from qworker.engine.sampling_params import SamplingParams

# Tokens a chat template adds around each message (role markers, separators): about 5 for
# SmolLM2's ChatML (<|im_start|>role\n ... <|im_end|>\n), rounded up for other templates.
MESSAGE_OVERHEAD_TOKENS = 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PoolSizing:
    """What turns jobs into blocks and blocks into workers. Every field is also a
    `qworker metrics-exporter` option (qworker/cli_options.py)."""

    capacity_blocks: int | None = field(
        default=None,
        metadata={
            "help": "One worker's KV pool in blocks: the workers' --num-kv-blocks (none: what live "
            "workers report; while none has reported, 1 worker whenever any job waits)"
        },
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV block: the workers' --block-size"})
    # Below 1, so that running jobs have room to grow and new ones start at once.
    target_utilization: float = field(
        default=0.8, metadata={"help": "Share of each worker's KV pool the pool should fill, in (0, 1]"}
    )
    chars_per_token: float = field(
        default=4.0, metadata={"help": "Characters per token, to size text prompts not yet tokenized"}
    )
    default_max_tokens: int = field(
        default=SamplingParams.max_tokens,
        metadata={"help": "max_tokens of a job that gives none: the engine's default"},
    )
    mean_job_tokens: int = field(
        default=512,
        metadata={"help": "Prompt plus max_tokens of a job whose body cannot be read (SQS before a receive)"},
    )

    def __post_init__(self) -> None:
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if self.chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")
        if self.mean_job_tokens < 1:
            raise ValueError(f"mean_job_tokens must be >= 1, got {self.mean_job_tokens}")

    @property
    def mean_job_blocks(self) -> int:
        return job_blocks(self.mean_job_tokens, 0, self.block_size)


@dataclass(frozen=True)
class Work:
    """Some jobs and the KV blocks they need."""

    num_jobs: int = 0
    num_blocks: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.num_jobs + other.num_jobs, self.num_blocks + other.num_blocks)


@dataclass(frozen=True)
class PoolDemand:
    """One reading of the signal, with the terms it came from."""

    waiting: Work
    running: Work
    # None: not known yet (not configured, and no worker has reported its pool).
    capacity_blocks: int | None
    desired_workers: int

    @property
    def demand_blocks(self) -> int:
        return self.waiting.num_blocks + self.running.num_blocks


def job_blocks(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a job holds when it has generated all of max_tokens (at least 1: even a job that
    fails at once needs a worker to fail it)."""
    return max(1, cdiv(num_prompt_tokens + max_tokens, block_size))


def estimate_job_tokens(job: dict[str, Any], sizing: PoolSizing) -> tuple[int, int]:
    """(prompt tokens, max_tokens) of a decoded job body, before any tokenizer has seen it."""
    num_prompt_tokens = 0
    if isinstance(job.get("prompt_token_ids"), list):
        num_prompt_tokens = len(job["prompt_token_ids"])
    elif isinstance(job.get("prompt"), str):
        num_prompt_tokens = math.ceil(len(job["prompt"]) / sizing.chars_per_token)
    elif isinstance(job.get("messages"), list):
        for message in job["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            num_chars = len(content) if isinstance(content, str) else 0
            num_prompt_tokens += math.ceil(num_chars / sizing.chars_per_token) + MESSAGE_OVERHEAD_TOKENS
    params = job.get("params")
    max_tokens = params.get("max_tokens") if isinstance(params, dict) else None
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = sizing.default_max_tokens
    return num_prompt_tokens, max_tokens


# A pooling job's `task` values (qworker/jobs/pooling_job.py): such a job is never decoded.
POOLING_TASKS = ("embed", "classify", "score")


def pooling_job_blocks(job: dict[str, Any], sizing: PoolSizing) -> int:
    """Blocks of a pooling job's prompts: each input (or, for score, each query + document pair)
    is its own sequence of prompt blocks, and no decode follows (at least 1)."""

    def text_tokens(text: object) -> int:
        return math.ceil(len(text) / sizing.chars_per_token) if isinstance(text, str) else 0

    if job.get("task") == "score":
        documents = job.get("documents")
        query_tokens = text_tokens(job.get("query"))
        lengths = [query_tokens + text_tokens(d) for d in documents] if isinstance(documents, list) else []
    else:
        inputs = job.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        lengths = [
            len(item) if isinstance(item, list) else text_tokens(item)
            for item in (inputs if isinstance(inputs, list) else [])
        ]
    return max(1, sum(cdiv(n, sizing.block_size) for n in lengths))


def body_blocks(body: bytes | str, sizing: PoolSizing) -> int:
    """Blocks of one job from its raw JSON body. A body that is not a job object counts 1 block:
    the worker fails it at once."""
    try:
        job = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return 1
    if not isinstance(job, dict):
        return 1
    if job.get("task") in POOLING_TASKS:
        return pooling_job_blocks(job, sizing)
    return job_blocks(*estimate_job_tokens(job, sizing), sizing.block_size)


def extrapolate(sampled_blocks: list[int], num_jobs: int, sizing: PoolSizing) -> Work:
    """`num_jobs` jobs of which `sampled_blocks` were read: the rest count the sample's mean (or
    the configured mean when nothing was read)."""
    if num_jobs <= 0:
        return Work()
    if not sampled_blocks:
        return Work(num_jobs, num_jobs * sizing.mean_job_blocks)
    total = sum(sampled_blocks)
    num_unread = max(0, num_jobs - len(sampled_blocks))
    return Work(num_jobs, total + math.ceil(num_unread * total / len(sampled_blocks)))


def desired_workers(
    num_demand_blocks: int, capacity_blocks: int, target_utilization: float, *, is_waiting: bool
) -> int:
    """ceil(demand / (capacity * target)); at least 1 while anything waits; 0 without demand."""
    needed = math.ceil(max(0, num_demand_blocks) / (capacity_blocks * target_utilization))
    return max(1, needed) if is_waiting else needed


def pool_demand(
    waiting: Work, running: Work, sizing: PoolSizing, capacity_blocks: int | None = None
) -> PoolDemand:
    """The signal from the waiting and the running work. No job anywhere: 0 workers. Capacity:
    the configured one, else `capacity_blocks` (reported by the workers); with neither, a pool
    with any job wants 1 worker, which will then report its capacity."""
    capacity = sizing.capacity_blocks or capacity_blocks
    total = waiting + running
    if capacity is None:
        desired = 1 if total.num_jobs > 0 else 0
    else:
        desired = desired_workers(
            total.num_blocks, capacity, sizing.target_utilization, is_waiting=waiting.num_jobs > 0
        )
    return PoolDemand(waiting, running, capacity, desired)
