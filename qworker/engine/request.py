from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qworker.engine.block_hash import BlockHash
from qworker.engine.sampler import PositionLogprobs
from qworker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qworker.engine.structured.state import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class Request:
    """One generation request as the engine core sees it.

    Progress is a counter: the model has computed KV for the first `num_computed_tokens` of
    `token_ids`. Prefill, chunked prefill, decode and resume after preemption are all the same
    rule: schedule `num_tokens - num_computed_tokens` more (capped by the budget). A prefix-cache
    hit only starts `num_computed_tokens` above 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    # Tie-breaker for the priority queue: order of arrival at the engine.
    arrival_index: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache when the request was first scheduled
    # (vLLM's num_cached_tokens); -1 until then. A preempted request's recompute does not change it.
    num_cached_tokens: int = -1
    stop_reason: int | str | None = None
    # Content hashes of the full blocks of token_ids, in order; the KV cache manager appends
    # them as blocks fill (each block is hashed once, and tokens never change).
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)
    # With sampling_params.logprobs: one per output token. With prompt_logprobs: entry p is the
    # logprob of prompt token p + 1, filled chunk by chunk; a preempted request recomputes its
    # prompt but does not report those positions again.
    logprobs: list[PositionLogprobs] = field(default_factory=list, repr=False)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list, repr=False)
    # With sampling_params.structured_outputs: this completion's matcher, advanced by the
    # scheduler as it takes each step's output; the plan carries its mask to the runner.
    grammar: GrammarState | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
