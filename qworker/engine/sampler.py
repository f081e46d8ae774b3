from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from qworker import envs
from qworker.engine.penalties import (
    AdjustedRow,
    LogitsAdjustments,
    apply_logit_bias_,
    apply_penalties_,
    apply_token_masks_,
)
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.structured.bitmask import apply_token_bitmask_


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    num_output_tokens: int
    # Set for requests with a seed: their draws then depend on nothing else in the batch.
    generator: torch.Generator | None
    # The request's logit adjustments (engine/penalties.py); None: it asks for none.
    adjustments: LogitsAdjustments | None = None
    # The tokens generated so far, where adjustments need them (penalties, bad words).
    output_token_ids: Sequence[int] = ()


@dataclass
class TokenBitmask:
    """The grammar masks of a step's constrained rows."""

    row_index: torch.Tensor  # [R] int64 rows of the logits
    bitmask: torch.Tensor  # [R, ceil(vocab / 32)] int32, see structured/bitmask.py


class Sampler:
    """Greedy, temperature, top-k, top-p and min-p sampling over a batch of logits.

    The order of a step, as vLLM v1's: (1) the structured-output grammar mask; (2) the masks
    and the bias: allowed_token_ids, bad_words, min_tokens (EOS and stop ids banned), logit_bias;
    (3) the penalties: repetition, frequency, presence (engine/penalties.py); then (4) greedy
    rows take the argmax of these logits, and random rows are divided by their temperature and
    cut by top-k, top-p and min-p before the draw. Logprobs are taken before all of it (raw).

    Random rows use the exponential-race trick (argmax of p / Exp(1) noise), so each row draws
    its own noise vector: a seeded row draws from its private generator.
    """

    def __init__(self, eos_token_ids: tuple[int, ...], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self._generator: torch.Generator | None = None
        self._seed = seed

    def _batch_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self._seed)
        return self._generator

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], token_bitmask: TokenBitmask | None = None
    ) -> list[int]:
        """logits: [N, vocab] float32, or the model's dtype as the lm_head computed them -> N token
        ids, in the class docstring's order; `logits` is changed in place. Greedy rows take the
        argmax of the (adjusted) logits (a bf16 -> fp32 copy changes no order); random rows are
        scaled and drawn in float32. Penalties are computed in float32 and written back in the
        logits' dtype."""
        assert logits.shape[0] == len(rows), f"{logits.shape[0]} logit rows for {len(rows)} requests"
        if token_bitmask is not None:
            apply_token_bitmask_(logits, token_bitmask.row_index, token_bitmask.bitmask)
        # A step where no row asks for an adjustment skips them all.
        adjusted = [
            AdjustedRow(i, row.adjustments, row.output_token_ids)
            for i, row in enumerate(rows)
            if row.adjustments is not None
        ]
        if adjusted:
            apply_token_masks_(logits, adjusted)
        self._apply_min_tokens(logits, rows)
        if adjusted:
            apply_logit_bias_(logits, adjusted)
            apply_penalties_(logits, adjusted)
        greedy = greedy_argmax(logits)
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not random_rows:
            return greedy.tolist()
        index = torch.tensor(random_rows, device=logits.device)
        sub = logits[index].float()
        params = [rows[i].params for i in random_rows]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        sub = sub / temperature[:, None]
        sub = _apply_top_k_top_p(sub, params)
        probs = sub.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            draw_noise(noise[j], rows[i].generator or self._batch_generator(logits.device))
        picked = (probs / noise).argmax(dim=-1)
        greedy[index] = picked
        return greedy.tolist()

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = logits.shape[-1]
        for i, row in enumerate(rows):
            if row.num_output_tokens < row.params.min_tokens:
                banned = list(row.params.stop_token_ids)
                if not row.params.ignore_eos:
                    banned.extend(self.eos_token_ids)
                # The engine rejects stop ids outside the vocabulary; an id past the logits can
                # never be sampled, so there is nothing to ban for it anyway.
                banned = [t for t in banned if 0 <= t < vocab]
                if banned:
                    logits[i, banned] = float("-inf")


def draw_noise(row: torch.Tensor, generator: torch.Generator) -> None:
    """row: [vocab] float32, contiguous: one sampled token's Exp(1) noise, from `generator`. The
    one draw a sampled token takes (skip_draws repeats it)."""
    row.exponential_(generator=generator)


def skip_draws(generator: torch.Generator, num_draws: int, vocab_size: int, device: torch.device) -> None:
    """Advance `generator` past `num_draws` sampled tokens' noise, as `Sampler.sample` drew it for
    logits `vocab_size` wide on a device of this kind: the same draws, made and thrown away, so
    the state reached is the same (exact, and cheap beside a prefill: about 60 us a draw for
    49,152 logits on the 2-core AVX2 EPYC)."""
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=device)
    for _ in range(num_draws):
        draw_noise(scratch, generator)


@functools.cache
def _cpu_argmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The C argmax of qworker_kernels.cpu_fused_ops; None where it cannot be built, where it was
    built without AVX-512 (there torch's argmax is faster), or the CPU kernels are off
    (QWORKER_DISABLE_CPU_KERNEL)."""
    if envs.QWORKER_DISABLE_CPU_KERNEL.get():
        return None
    from qworker_kernels import cpu_fused_ops

    if not cpu_fused_ops.is_available() or not cpu_fused_ops.built_with_avx512():
        return None
    return cpu_fused_ops.argmax_rows


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] -> [N] int64, torch.argmax(dim=-1): the first of equal maxima, the first
    NaN of a row holding one. On the CPU a one-pass C kernel: for 128 rows of 49,152 logits on one
    core of the 2-core AMX Xeon (loaded), torch's argmax took 8-30 ms in fp32, the kernel 1-2.5 ms
    (0.7-1.6 ms in bf16, the dtype the lm_head gives). Without it, fp32 goes through numpy's
    argmax (the same first-maximum and first-NaN rule, SIMD): for 256 rows of 49,152 logits on one
    core of the 2-core AVX2 EPYC (loaded), 38 ms against torch's 116 ms."""
    if (
        logits.is_cpu
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.shape[1] > 0
        and logits.stride(1) == 1
    ):
        argmax = _cpu_argmax()
        if argmax is not None:
            return argmax(logits)
        if logits.dtype is torch.float32:
            return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [N, vocab] (already temperature-scaled). Masks tokens outside top-k / top-p."""
    needs_top_k = any(p.top_k > 0 for p in params)
    needs_top_p = any(p.top_p < 1.0 for p in params)
    if not needs_top_k and not needs_top_p:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if needs_top_k:
        # A top_k past the vocabulary keeps every token (as in vLLM); capped here because a
        # Python int that large does not fit in a tensor.
        top_k = torch.tensor(
            [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=logits.device
        )
        ranks = torch.arange(vocab, device=logits.device)
        remove |= ranks[None, :] >= top_k[:, None]
    if needs_top_p:
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Remove a token when the mass before it already reaches top_p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)


@dataclass
class PositionLogprobs:
    """The raw logprobs at one position: of the token that came next there (sampled, or the next
    prompt token), its rank (1 = most likely; ties share the better rank), and the top-k
    alternatives in descending order."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[PositionLogprobs]:
    """logits: [N, vocab] raw (before temperature and any cut); token_ids: [N] the token taken at
    each row; num_top: k per row. One log_softmax and one topk (at the largest k) for the batch."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    max_top = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top > 0 else (None, None)
    chosen_list = chosen[:, 0].tolist()
    ranks_list = ranks.tolist()
    ids_list = token_ids.tolist()
    top_values_list = top_values.tolist() if top_values is not None else []
    top_ids_list = top_ids.tolist() if top_ids is not None else []
    return [
        PositionLogprobs(
            token_id=ids_list[i],
            logprob=chosen_list[i],
            rank=ranks_list[i],
            top_token_ids=top_ids_list[i][:k] if k else [],
            top_logprobs=top_values_list[i][:k] if k else [],
        )
        for i, k in enumerate(num_top)
    ]
