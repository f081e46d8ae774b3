"""The sampler's logit adjustments: allowed token ids, bad words, logit bias, and the repetition,
frequency and presence penalties, applied in place to a step's logits as whole-tensor operations
over the rows that ask for them (rows that ask for none are not touched, and a step where no row
asks for any never comes here).

The math is vLLM's: `apply_penalties` (vllm/model_executor/layers/utils.py) and its
`get_token_bin_counts_and_mask`, with the v1 sampler's `apply_allowed_token_ids` and
`apply_bad_words` and the built-in `LogitBiasLogitsProcessor` (vllm/v1/sample/). The repetition
penalty is transformers' `RepetitionPenaltyLogitsProcessor` over the prompt and the output: a
seen token's logit is divided by the penalty when positive and multiplied by it otherwise.
Presence and frequency penalties are OpenAI's: over the generated tokens only,
logit -= frequency * count + presence * [count > 0].

Each request's part is built once, when it gets a row (`LogitsAdjustments.of`); a step then
needs only its rows' output tokens, counted into a [rows, vocab] table with one index_add.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from qworker.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsAdjustments:
    """One request's logit adjustments, fixed while it runs."""

    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    # [P] int64: the prompt's distinct token ids; empty unless repetition_penalty != 1.
    prompt_token_ids: np.ndarray
    bias_token_ids: np.ndarray  # [B] int64
    bias_values: np.ndarray  # [B] float32
    # [A] int64; None: every token is allowed.
    allowed_token_ids: np.ndarray | None
    # Each banned word's token sequences (bad_words_token_ids).
    bad_words_token_ids: tuple[tuple[int, ...], ...]

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_output_tokens(self) -> bool:
        """The step must hand over the tokens generated so far (penalties count them, a banned
        word of several tokens matches its start against their end)."""
        return self.has_penalties or bool(self.bad_words_token_ids)

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
    ) -> LogitsAdjustments | None:
        """The adjustments `params` asks for (None when it asks for none)."""
        if not params.adjusts_logits:
            return None
        bias = params.logit_bias or {}
        prompt = (
            np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
            if params.repetition_penalty != 1.0
            else np.zeros(0, dtype=np.int64)
        )
        return cls(
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            prompt_token_ids=prompt,
            bias_token_ids=np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
            bias_values=np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
            allowed_token_ids=(
                np.asarray(params.allowed_token_ids, dtype=np.int64)
                if params.allowed_token_ids is not None
                else None
            ),
            bad_words_token_ids=bad_words_token_ids,
        )


@dataclass(frozen=True)
class AdjustedRow:
    """A row of the step's logits and what to do to it."""

    index: int
    adjustments: LogitsAdjustments
    # The tokens generated so far (empty where adjustments.needs_output_tokens is false).
    output_token_ids: Sequence[int]


def bad_words_token_ids(
    words: Sequence[str], encode: Callable[[str], list[int]], vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """The token sequences that `words` ban, as vLLM's `SamplingParams.update_from_tokenizer`
    builds them: each word stripped of leading whitespace, encoded as it is (the start of a text)
    and with a leading space (inside one), the second kept when it is a different sequence of
    the same length (a tokenizer that adds the space itself gives the same one). A sequence
    holding an id past the model's logits can never be generated, so it is dropped."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        candidates = [plain]
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            candidates.append(spaced)
        sequences.extend(c for c in candidates if c and all(0 <= t < vocab_size for t in c))
    return tuple(sequences)


def apply_token_masks_(logits: torch.Tensor, rows: Sequence[AdjustedRow]) -> None:
    """logits: [N, vocab]. allowed_token_ids, then bad words: banned tokens become -inf, in place."""
    vocab = logits.shape[-1]
    device = logits.device
    allowed = [row for row in rows if row.adjustments.allowed_token_ids is not None]
    if allowed:
        index = torch.tensor([row.index for row in allowed], device=device)
        ids = [row.adjustments.allowed_token_ids for row in allowed]
        lengths = [len(a) for a in ids if a is not None]
        row_of_id = np.repeat(np.arange(len(allowed)), lengths)
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device)
        keep[torch.from_numpy(row_of_id).to(device), torch.from_numpy(np.concatenate(ids)).to(device)] = True
        sub = logits.index_select(0, index).masked_fill_(~keep, float("-inf"))
        logits.index_copy_(0, index, sub)
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row in rows:
        output = row.output_token_ids
        for sequence in row.adjustments.bad_words_token_ids:
            prefix_len = len(sequence) - 1
            # vLLM's rule: the word's last token is banned where the output ends with the rest.
            if prefix_len > len(output):
                continue
            if prefix_len == 0 or list(output[len(output) - prefix_len :]) == list(sequence[:prefix_len]):
                banned_rows.append(row.index)
                banned_ids.append(sequence[-1])
    if banned_rows:
        logits[torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device)] = float(
            "-inf"
        )


def apply_logit_bias_(logits: torch.Tensor, rows: Sequence[AdjustedRow]) -> None:
    """logits: [N, vocab]. Adds each row's logit_bias, in place (one index_put for the batch)."""
    biased = [row for row in rows if row.adjustments.bias_token_ids.size]
    if not biased:
        return
    device = logits.device
    lengths = [row.adjustments.bias_token_ids.size for row in biased]
    row_index = np.repeat(np.array([row.index for row in biased], dtype=np.int64), lengths)
    ids = np.concatenate([row.adjustments.bias_token_ids for row in biased])
    values = torch.from_numpy(np.concatenate([row.adjustments.bias_values for row in biased]))
    logits.index_put_(
        (torch.from_numpy(row_index).to(device), torch.from_numpy(ids).to(device)),
        values.to(device=device, dtype=logits.dtype),
        accumulate=True,
    )


def output_token_counts(rows: Sequence[AdjustedRow], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] float32: how often each token occurs in each row's output (a bincount
    of row * vocab + token, by one index_add over the batch's output tokens)."""
    lengths = np.fromiter((len(row.output_token_ids) for row in rows), dtype=np.int64, count=len(rows))
    tokens = np.fromiter(
        itertools.chain.from_iterable(row.output_token_ids for row in rows),
        dtype=np.int64,
        count=int(lengths.sum()),
    )
    flat = np.repeat(np.arange(len(rows), dtype=np.int64) * vocab, lengths) + tokens
    counts = torch.zeros(len(rows) * vocab, dtype=torch.float32, device=device)
    flat_t = torch.from_numpy(flat).to(device)
    counts.index_add_(0, flat_t, torch.ones(flat.size, dtype=torch.float32, device=device))
    return counts.view(len(rows), vocab)


def apply_penalties_(logits: torch.Tensor, rows: Sequence[AdjustedRow]) -> None:
    """logits: [N, vocab]. The repetition, frequency and presence penalties of the rows that set
    one, in vLLM's `apply_penalties` order, computed in float32 and written back in place."""
    penalized = [row for row in rows if row.adjustments.has_penalties]
    if not penalized:
        return
    device = logits.device
    vocab = logits.shape[-1]
    index = torch.tensor([row.index for row in penalized], device=device)
    sub = logits.index_select(0, index).float()  # [P, vocab]
    counts = output_token_counts(penalized, vocab, device)  # [P, vocab]
    repetition = [row.adjustments.repetition_penalty for row in penalized]
    if any(p != 1.0 for p in repetition):
        seen = counts > 0
        lengths = [row.adjustments.prompt_token_ids.size for row in penalized]
        flat = np.repeat(np.arange(len(penalized), dtype=np.int64) * vocab, lengths) + np.concatenate(
            [row.adjustments.prompt_token_ids for row in penalized]
        )
        seen.view(-1)[torch.from_numpy(flat).to(device)] = True
        penalty = torch.tensor(repetition, dtype=torch.float32, device=device)[:, None]
        scale = torch.where(seen, penalty, 1.0)
        sub = torch.where(sub > 0, sub / scale, sub * scale)
    frequency = [row.adjustments.frequency_penalty for row in penalized]
    if any(f != 0.0 for f in frequency):
        sub -= torch.tensor(frequency, dtype=torch.float32, device=device)[:, None] * counts
    presence = [row.adjustments.presence_penalty for row in penalized]
    if any(p != 0.0 for p in presence):
        sub -= torch.tensor(presence, dtype=torch.float32, device=device)[:, None] * (counts > 0)
    logits.index_copy_(0, index, sub.to(logits.dtype))
