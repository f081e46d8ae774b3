"""The runner's persistent rows: a request keeps its row across steps, each step writes only the
blocks its table gained, and a freed row comes back zeroed to the next request."""

from __future__ import annotations

import numpy as np
import pytest

from qworker.engine.input_batch import InputBatch
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler_output import NewRequestData, ScheduledRequest

pytestmark = pytest.mark.timeout(30)


def new(request_id: str, num_tokens: int = 3) -> NewRequestData:
    tokens = list(range(1, num_tokens + 1))
    return NewRequestData(request_id, tokens, list(tokens), SamplingParams(), 0)


def chunk(request_id: str, block_ids: list[int], start: int = 0, tokens: tuple[int, ...] = (1, 2, 3)):
    return ScheduledRequest(request_id, list(tokens), start, block_ids, True, start + len(tokens))


def test_rows_persist_and_tables_grow_in_place() -> None:
    batch = InputBatch(4, 5)
    a, b = batch.add(new("a")), batch.add(new("b"))
    assert (a.row, b.row) == (0, 1)
    batch.update(chunk("a", [7]))
    batch.update(chunk("b", [3, 4]))
    batch.update(chunk("a", [7, 9], start=3, tokens=(5,)))
    assert batch.block_table[:2].tolist() == [[7, 9, 0, 0, 0], [3, 4, 0, 0, 0]]
    assert batch.num_blocks[:2].tolist() == [2, 2]
    with pytest.raises(AssertionError, match="shrank"):
        batch.update(chunk("a", [7]))


def test_a_freed_row_is_zeroed_and_reused_lowest_first() -> None:
    batch = InputBatch(3, 4)
    for request_id in "abc":
        batch.add(new(request_id))
        batch.update(chunk(request_id, [1, 2, 3]))
    batch.remove("b")
    batch.remove("a")
    batch.remove("unknown")  # a request that never had a row
    assert not batch.block_table[:2].any() and batch.num_blocks[:2].tolist() == [0, 0]
    assert batch.add(new("d")).row == 0
    assert batch.add(new("e")).row == 1
    with pytest.raises(AssertionError, match="no free row"):
        batch.add(new("f"))
    assert len(batch) == 3


def test_token_ids_are_kept_only_when_asked() -> None:
    batch = InputBatch(2, 4, keep_token_ids=True)
    state = batch.add(new("a"))
    batch.update(chunk("a", [0], start=0))
    batch.update(chunk("a", [0], start=3, tokens=(8,)))
    assert state.token_ids == [1, 2, 3, 8]
    assert InputBatch(2, 4).add(new("a")).token_ids is None
    assert np.array_equal(batch.block_table[state.row], [0, 0, 0, 0])
