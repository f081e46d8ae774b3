"""What the scheduler hands out: the plan of one step for the runner (plain data: the runner needs
nothing else, and never sees a Request), and what taking the step's output did to each request,
for the output processor. As vLLM v1's `v1/core/sched/output.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qworker.engine.request import Request
from qworker.engine.sampling_params import SamplingParams
from qworker.model.pooler import PoolingSpec


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner does not hold (new, or resumed after a preemption), in full: what stays
    fixed while it runs."""

    request_id: str
    prompt_token_ids: list[int]
    # Every token known at admission (prompt, then outputs generated before a preemption).
    token_ids: list[int]
    sampling_params: SamplingParams
    # Prompt positions scored before a preemption (prompt_logprobs): not reported again.
    num_scored_prompt_tokens: int
    # Output tokens an earlier run generated (a resumed request): its seeded generator skips
    # the draws they took.
    num_resumed_tokens: int = 0
    # The device slot of the request's LoRA adapter while it runs (-1: the base model).
    lora_slot: int = -1
    # A pooling request: what the runner pools at its last chunk (it samples nothing).
    pooling: PoolingSpec | None = None
    # The token sequences of sampling_params.bad_words (engine/penalties.py).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


# Not frozen: one per scheduled request and step, and a frozen dataclass costs 5x to build
# (2.1 against 0.4 us with six fields, on the 2-core AVX2 EPYC). Nothing changes them.
@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute KV for `token_ids` at positions from `start_position`."""

    request_id: str
    token_ids: list[int]
    start_position: int
    # The whole block table; the runner's input batch writes only the blocks it does not hold yet.
    block_ids: list[int]
    # True when this chunk reaches the last known token, so the step samples the next one.
    needs_sample: bool
    # The request's tokens (prompt and output) when the plan was made.
    num_tokens: int


@dataclass(frozen=True)
class GrammarRows:
    """The grammar masks of the structured-output requests a step samples."""

    request_ids: list[str]
    bitmask: np.ndarray  # [len(request_ids), ceil(vocab / 32)] int32, see structured/bitmask.py


@dataclass
class SchedulerOutput:
    """The plan for one step. Plain data: the runner turns it into tensors."""

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # Requests in `scheduled` that the runner does not hold yet (admitted in this plan).
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left since the previous plan; the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Requests finished by the scheduler itself: alone in the cache, they could not grow.
    capacity_finished_request_ids: list[str] = field(default_factory=list)
    grammar_rows: GrammarRows | None = None
    # LoRA slots to fill before the step runs: (slot, the adapter in host memory, a
    # qworker.lora.peft_adapter.LoRAAdapter).
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)  # one per token and step: not frozen, as ScheduledRequest
class RequestUpdate:
    """One token a request took (sampled, or forced by its grammar), as the scheduler applied it:
    the request (read-only past the scheduler) has the token appended, and is finished when a
    token-level stop rule ended it (EOS, stop_token_ids, its grammar, max_tokens, the context)."""

    request: Request
    token_id: int
    # The request stopped at an EOS token: the token's text is not shown.
    is_eos_stop: bool = False
    # Set when the request ended because its grammar refused the token.
    grammar_error: str | None = None
