"""Logprobs and prompt logprobs on the tiny model against a transformers forward pass on the same
ids: every configuration that changes how a prompt is computed (chunks, preemption, the prefix
cache), top-k order and ranks, and sampling settings that must not change raw logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidParamsError
from tests.conftest import run_to_completion, tiny_engine

pytestmark = pytest.mark.timeout(120)

TOL = 1e-4
TOP = 5


def prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (2, 7, 13, 30)]


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the distribution of the token after position p."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(dim=-1)


def run(engine, prompt_list, params):
    ids = [engine.add_request(f"r{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(prompt_list)]
    outs = run_to_completion(engine)
    return [outs[i] for i in ids]


def check_position(entry, expected_token: int, reference: torch.Tensor, k: int) -> None:
    """entry: dict token id -> Logprob at one position; reference: [vocab] HF logprobs there."""
    chosen = entry[expected_token]
    assert next(iter(entry)) == expected_token, "the chosen token comes first"
    assert abs(chosen.logprob - reference[expected_token].item()) < TOL
    assert chosen.rank == int((reference > reference[expected_token]).sum()) + 1
    ref_top = reference.topk(k).indices.tolist() if k else []
    assert len(entry) == k + (expected_token not in ref_top)
    for rank, token in enumerate(ref_top, start=1):
        assert entry[token].rank == rank
        assert abs(entry[token].logprob - reference[token].item()) < TOL
    values = [entry[t].logprob for t in ref_top]
    assert values == sorted(values, reverse=True)


ENGINE_ARGS = [
    {},
    {"max_num_batched_tokens": 8},
    {"max_num_batched_tokens": 3, "block_size": 1},
    # 4 requests of up to 30 + 10 tokens in 16 blocks of 4: decodes preempt the newest.
    {"num_kv_blocks": 16},
]


@pytest.mark.parametrize(
    "engine_args", ENGINE_ARGS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default"
)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_transformers(tiny_llama, engine_args, temperature) -> None:
    engine = tiny_engine(tiny_llama, **engine_args)
    params = SamplingParams(
        max_tokens=10,
        temperature=temperature,
        top_k=20,
        seed=7,
        ignore_eos=True,
        logprobs=TOP,
        prompt_logprobs=TOP,
    )
    outs = run(engine, prompts(), params)
    if "num_kv_blocks" in engine_args:
        assert sum(o.num_preemptions for o in outs) > 0, "the configuration must force a preemption"
    for prompt, out in zip(prompts(), outs, strict=True):
        completion = out.outputs[0]
        ids = prompt + completion.token_ids
        reference = hf_logprobs(tiny_llama, ids)
        # Prompt: None first, then one entry per prompt token, never duplicated by a recompute.
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            check_position(out.prompt_logprobs[i], prompt[i], reference[i - 1], TOP)
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
        for j, token in enumerate(completion.token_ids):
            check_position(completion.logprobs[j], token, reference[len(prompt) + j - 1], TOP)
    assert engine.kv_stats().num_used_blocks == 0


def test_logprobs_are_raw_whatever_the_sampling_settings(tiny_llama) -> None:
    prompt = prompts()[2]
    base = dict(max_tokens=1, ignore_eos=True, logprobs=3)
    greedy = run(tiny_engine(tiny_llama), [prompt], SamplingParams(temperature=0.0, **base))[0]
    cut = run(
        tiny_engine(tiny_llama), [prompt], SamplingParams(temperature=0.0, top_p=0.1, min_p=0.5, **base)
    )[0]
    assert greedy.outputs[0].logprobs == cut.outputs[0].logprobs


def test_zero_alternatives_gives_the_chosen_token_only(tiny_llama) -> None:
    out = run(
        tiny_engine(tiny_llama),
        [prompts()[1]],
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=0, prompt_logprobs=0),
    )[0]
    assert all(len(entry) == 1 for entry in out.outputs[0].logprobs)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])
    assert out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].rank == 1


def test_without_logprobs_nothing_is_reported(tiny_llama) -> None:
    out = run(tiny_engine(tiny_llama), [prompts()[1]], SamplingParams(max_tokens=3))[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None


def test_prompt_logprobs_skip_the_prefix_cache(tiny_llama) -> None:
    """A second request with the same prompt would hit the cache; asking prompt logprobs, it
    computes its whole prompt, and its logprobs equal the first one's."""
    engine = tiny_engine(tiny_llama, enable_prefix_caching=True)
    prompt = prompts()[3]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    first = run(engine, [prompt], params)[0]
    hits = engine.kv_stats().num_prefix_cache_hits
    second = run(engine, [prompt], params)[0]
    assert engine.kv_stats().num_prefix_cache_hits == hits
    assert second.prompt_logprobs == first.prompt_logprobs
    # Without prompt logprobs the same prompt does hit.
    run(engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.kv_stats().num_prefix_cache_hits > hits


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_logprobs_bounds(bad) -> None:
    with pytest.raises(InvalidParamsError):
        SamplingParams(logprobs=bad)
    with pytest.raises(InvalidParamsError):
        SamplingParams(prompt_logprobs=bad)
