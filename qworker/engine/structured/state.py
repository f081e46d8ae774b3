"""One completion's grammar state, kept on its Request, and the per-step batch operations over
many of them: fill the masks of the rows a step samples (the scheduler, into the plan), advance
the matchers by the sampled tokens (the scheduler, as it takes the output), and find the tokens
the grammar forces (fast-forward, the output processor).

Preemption by recompute keeps every token a request has (prompt and output), so a matcher stays
valid across it; `num_tokens` records how many output tokens the matcher has consumed, and the
scheduler checks it against the request before each mask it puts in a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qworker.engine.structured.backend import GrammarBackend, Matcher
from qworker.engine.structured.bitmask import allowed_counts, first_allowed, num_mask_words


@dataclass(eq=False)
class GrammarState:
    backend: GrammarBackend
    matcher: Matcher
    vocab_size: int
    # Output tokens the matcher has consumed.
    num_tokens: int = 0
    # [words] int32: the allowed next tokens at the matcher's position; None when stale.
    mask: np.ndarray | None = field(default=None, repr=False)
    # Set once the matcher refused a token (the mask was not honoured): the request fails.
    error: str | None = None

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()


def fill_masks(states: list[GrammarState]) -> np.ndarray:
    """[len(states), words] int32, each state's mask at its position (computed where stale, in
    parallel across rows by the backend, and kept on the state)."""
    assert states, "no grammar states to mask"
    words = num_mask_words(states[0].vocab_size)
    stale = [s for s in states if s.mask is None]
    if stale:
        fresh = np.zeros((len(stale), words), dtype=np.int32)
        stale[0].backend.fill_masks([s.matcher for s in stale], fresh)
        for state, row in zip(stale, fresh, strict=True):
            state.mask = row
    return np.stack([s.mask for s in states])  # type: ignore[misc]


def consume(pairs: list[tuple[GrammarState, int]]) -> None:
    """Advance each state by its token (in parallel); a refused token sets `error`."""
    if not pairs:
        return
    backend = pairs[0][0].backend
    accepted = backend.consume([(state.matcher, token) for state, token in pairs])
    for (state, token), ok in zip(pairs, accepted, strict=True):
        state.mask = None
        if ok:
            state.num_tokens += 1
        else:
            state.error = (
                f"the grammar refused token {token}: {state.matcher.get_error() or 'no reason given'}"
            )


def forced_tokens(states: list[GrammarState]) -> list[int | None]:
    """Per state, the one token its grammar allows next, or None where it allows several (or,
    being complete, none). Computes and keeps the states' masks."""
    live = [s for s in states if s.error is None and not s.is_stopped]
    result: list[int | None] = [None] * len(states)
    if not live:
        return result
    masks = fill_masks(live)
    counts = allowed_counts(masks)
    single = np.flatnonzero(counts == 1)
    if single.size == 0:
        return result
    tokens = first_allowed(masks[single])
    position = {id(s): i for i, s in enumerate(states)}
    for row, token in zip(single.tolist(), tokens.tolist(), strict=True):
        result[position[id(live[row])]] = token
    return result
