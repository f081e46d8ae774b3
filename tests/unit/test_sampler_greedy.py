"""The sampler on logits in the model's dtype (bf16, as the lm_head computes them) gives the tokens
it gives on the same logits in float32: greedy rows through the C argmax (torch's tie and NaN
rule), random rows scaled and drawn in float32, min_tokens bans applied either way."""

from __future__ import annotations

import pytest
import torch

from qworker.engine.sampler import Sampler, SamplingRow, greedy_argmax
from qworker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

VOCAB = 4099  # not a multiple of the kernel's 32-element blocks


def rows_of(params: list[SamplingParams], num_output_tokens: int = 5) -> list[SamplingRow]:
    # Seeded rows draw from their own generator, built fresh per call so both runs draw alike.
    return [
        SamplingRow(
            p, num_output_tokens, torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        )
        for p in params
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_is_torch_argmax(dtype):
    logits = (torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(1)) * 3).round().to(dtype)
    logits[3] = float("-inf")
    logits[4, 17] = float("nan")
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))


def test_bf16_logits_sample_as_their_float32_copy():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(24, VOCAB, generator=gen) * 4).to(torch.bfloat16)
    params = []
    for i in range(24):
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=i))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=8, temperature=0.0))
        else:
            # min_tokens bans the row's greedy pick (as a stop token) until 8 tokens are out.
            banned = int(logits[i].float().argmax())
            params.append(
                SamplingParams(max_tokens=8, temperature=0.0, min_tokens=8, stop_token_ids=[banned])
            )
    sampler = Sampler(eos_token_ids=(2,), seed=7)
    from_bf16 = sampler.sample(logits.clone(), rows_of(params))
    from_fp32 = Sampler(eos_token_ids=(2,), seed=7).sample(logits.float(), rows_of(params))
    assert from_bf16 == from_fp32
    for i in range(2, 24, 3):
        assert from_bf16[i] != int(logits[i].float().argmax())
    greedy_rows = [i for i in range(24) if i % 3 == 1]
    assert [from_bf16[i] for i in greedy_rows] == logits[greedy_rows].float().argmax(dim=-1).tolist()
