"""The runner's persistent rows (vLLM v1's `gpu_input_batch.py`): one row per request the runner
holds, kept across steps. A request gets a row when a plan brings it in full (`NewRequestData`)
and keeps it until a plan says it finished or was preempted; in between, each step writes only
the blocks its table gained into the row's block table, in place."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from qworker.engine.penalties import LogitsAdjustments
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler_output import NewRequestData, ScheduledRequest


@dataclass
class CachedRequestState:
    """What the runner keeps of one request between steps."""

    request_id: str
    row: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Prompt positions scored so far (prompt_logprobs): a recompute after preemption skips them.
    num_scored_prompt_tokens: int
    # Every token the runner has seen for this request; kept only where a step needs the whole
    # sequence (longrope's recompute past its original context, penalties and bad words that
    # read the output), else None.
    token_ids: list[int] | None
    # Output tokens an earlier run generated (NewRequestData.num_resumed_tokens).
    num_resumed_tokens: int = 0
    # The sampler's logit adjustments (engine/penalties.py); None: the request asks for none.
    adjustments: LogitsAdjustments | None = None

    def output_token_ids(self, num_tokens: int) -> list[int]:
        """The first `num_tokens - num_prompt_tokens` output tokens (token_ids must be kept)."""
        assert self.token_ids is not None, f"request {self.request_id}: the runner keeps no token ids"
        return self.token_ids[self.num_prompt_tokens : num_tokens]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputBatch:
    """Rows for up to `max_num_rows` requests; each row's block table has `max_blocks_per_row`
    columns. A freed row is reused by the next request (the lowest free row first), so rows are
    not contiguous: a step gathers its rows by index."""

    def __init__(self, max_num_rows: int, max_blocks_per_row: int, *, keep_token_ids: bool = False) -> None:
        self.keep_token_ids = keep_token_ids
        # [rows, max_blocks_per_row] int32; columns past a row's num_blocks are 0, as padding.
        self.block_table = np.zeros((max_num_rows, max_blocks_per_row), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_rows, dtype=np.int64)  # [rows]
        # [rows] the LoRA slot of each row's request (-1: the base model).
        self.lora_slot = np.full(max_num_rows, -1, dtype=np.int64)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_rows))  # a heap: the lowest free row first

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, new: NewRequestData) -> CachedRequestState:
        assert new.request_id not in self.requests, f"request {new.request_id} already has a row"
        assert self._free_rows, f"no free row for request {new.request_id}"
        row = heapq.heappop(self._free_rows)
        adjustments = LogitsAdjustments.of(new.sampling_params, new.prompt_token_ids, new.bad_words_token_ids)
        keep_token_ids = self.keep_token_ids or (adjustments is not None and adjustments.needs_output_tokens)
        state = CachedRequestState(
            request_id=new.request_id,
            row=row,
            prompt_token_ids=new.prompt_token_ids,
            sampling_params=new.sampling_params,
            num_scored_prompt_tokens=new.num_scored_prompt_tokens,
            token_ids=list(new.token_ids) if keep_token_ids else None,
            num_resumed_tokens=new.num_resumed_tokens,
            adjustments=adjustments,
        )
        self.requests[new.request_id] = state
        self.lora_slot[row] = new.lora_slot
        return state

    def remove(self, request_id: str) -> None:
        """Free the request's row; unknown ids (a request that never ran) are ignored."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        row = state.row
        self.block_table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.lora_slot[row] = -1
        heapq.heappush(self._free_rows, row)

    def update(self, item: ScheduledRequest) -> CachedRequestState:
        """Take one scheduled chunk: write the blocks the row lacks (tables only grow while a
        request holds a row) and, where kept, the chunk's new tokens. Returns the row's state."""
        state = self.requests[item.request_id]
        row = state.row
        num_held = int(self.num_blocks[row])
        num_blocks = len(item.block_ids)
        assert num_blocks >= num_held, f"request {item.request_id}: block table shrank while running"
        if num_blocks > num_held:
            self.block_table[row, num_held:num_blocks] = item.block_ids[num_held:]
            self.num_blocks[row] = num_blocks
        if state.token_ids is not None:
            end = item.start_position + len(item.token_ids)
            if end > len(state.token_ids):
                state.token_ids.extend(item.token_ids[len(state.token_ids) - item.start_position :])
        return state
