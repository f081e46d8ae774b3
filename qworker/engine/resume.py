"""Continuing a request from output tokens generated earlier, elsewhere (a released or killed
worker's job, docs/queues.md "Resume from tokens"): what the engine is given, and the checks
that say whether it can continue from them. Plain data, no torch: the worker imports it.

A resumed request is prefilled with prompt + resumed tokens (prefix caching may hit), counts them
as output already produced (max_tokens, min_tokens, the stop rules), never emits them again, and
its seeded generator skips the draws they took, so that with `batch_invariant` it ends with the
token ids of an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from qworker.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ResumeFrom:
    """Output tokens a request already generated, to continue from. `text`: what was streamed for
    them, when known; the engine checks its own decoding of the tokens against it, so that its
    next text delta continues that text exactly (None skips the check)."""

    token_ids: list[int]
    text: str | None = None


def resume_problem(
    resume: ResumeFrom,
    params: SamplingParams,
    *,
    eos_token_ids: Collection[int],
) -> str | None:
    """Why the request cannot continue from `resume.token_ids`, or None. Applies the scheduler's
    token stop rules (`Scheduler._check_stop`) to each resumed token: a run that would have stopped
    on one of them is not continued past it. The vocabulary and the context are checked with the
    prompt (InputProcessor.validate_prompt_token_ids on prompt + tokens)."""
    if params.n > 1:
        return "n > 1: only completion 0's tokens are stored"
    if params.logprobs is not None or params.prompt_logprobs is not None:
        return "logprobs: the stored tokens carry none"
    if params.structured_outputs is not None:
        return "structured outputs: the grammar's state and its forced tokens are not stored"
    token_ids = resume.token_ids
    if len(token_ids) >= params.max_tokens:
        return f"{len(token_ids)} stored tokens reach max_tokens ({params.max_tokens})"
    stop_ids = set(params.stop_token_ids)
    eos = set() if params.ignore_eos else set(eos_token_ids)
    for i, token_id in enumerate(token_ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            return f"stored token {i} is not a token id: {token_id!r}"
        if i + 1 >= params.min_tokens and (token_id in eos or token_id in stop_ids):
            return f"stored token {i} ({token_id}) is a stop: the run ended there"
    return None
