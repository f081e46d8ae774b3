"""Logprobs and prompt logprobs of the real SmolLM2-135M-Instruct in float32 against a transformers
forward pass on the same ids (within 1e-3): all at once, every prompt in chunks of 8 tokens, and
with preemptions (prompt logprobs are reported once, not again after the recompute). The first two
run on one engine (its token budget set per test; the prefix cache off, so that the chunked run
computes every prompt token again), the preemptions on a pool of their own."""

from __future__ import annotations

import pytest
import torch

from qworker import LLM, SamplingParams
from qworker.utils import cdiv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOL = 1e-3
TOP = 4
MAX_TOKENS = 20
BLOCK = 16

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "told stories about the storms he had seen and the fish he had almost caught.",
    "List three prime numbers and explain why each of them is prime, in one short sentence "
    "per number, without using any mathematical notation at all, please.",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from qworker.model.loader import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("smollm2").path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids():
    from transformers import AutoTokenizer

    from qworker.model.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2").path)
    return [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the log-distribution of the token after position p."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def check(entry, token: int, ref: torch.Tensor) -> None:
    """entry: the engine's {token id: Logprob} at one position; ref: [vocab] transformers' there."""
    chosen = entry[token]
    assert next(iter(entry)) == token, "the taken token comes first"
    assert abs(chosen.logprob - ref[token].item()) < TOL
    # The rank counts the tokens more likely; those within TOL of it may fall either side.
    assert int((ref > ref[token] + TOL).sum()) + 1 <= chosen.rank <= int((ref > ref[token] - TOL).sum()) + 1
    top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if t != token or lp.rank <= TOP)
    assert [rank for rank, _, _ in top] == list(range(1, TOP + 1))
    values = [lp for _, _, lp in top]
    assert values == sorted(values, reverse=True)
    for _, t, lp in top:
        assert abs(lp - ref[t].item()) < TOL
    # They are transformers' top k, up to near-ties at the cut.
    assert min(values) > ref.topk(TOP).values[-1].item() - TOL
    if chosen.rank <= TOP:
        assert top[chosen.rank - 1][1] == token


@pytest.fixture(scope="module")
def roomy_llm() -> LLM:
    """400 blocks, the default budget of 2048 (a test may change it and put it back)."""
    return LLM("smollm2", dtype="float32", block_size=BLOCK, num_kv_blocks=400, enable_prefix_caching=False)


@pytest.mark.parametrize(
    "config",
    ["all_at_once", "chunked_8", "preemption"],
)
def test_logprobs_match_transformers(roomy_llm, hf_model, prompt_ids, config) -> None:
    if config == "preemption":
        # Room for every prompt and one block more: decodes crossing a block boundary preempt.
        num_blocks = sum(cdiv(len(p), BLOCK) for p in prompt_ids) + 1
        llm = LLM("smollm2", dtype="float32", block_size=BLOCK, num_kv_blocks=num_blocks)
    else:
        llm = roomy_llm
    scheduler = llm.llm_engine.scheduler
    budget = scheduler.max_num_batched_tokens
    if config == "chunked_8":
        scheduler.max_num_batched_tokens = 8
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=i,
            ignore_eos=True,
            logprobs=TOP,
            prompt_logprobs=TOP,
        )
        for i in range(len(prompt_ids))
    ]
    computed_before = scheduler.num_prompt_tokens_computed
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    finally:
        scheduler.max_num_batched_tokens = budget
    if config != "preemption":  # every prompt token computed once: nothing came from a cache
        assert scheduler.num_prompt_tokens_computed - computed_before == sum(len(p) for p in prompt_ids)
    if config == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompt_ids, outs, strict=True):
        completion = out.outputs[0]
        assert len(completion.token_ids) == MAX_TOKENS
        ref = reference(hf_model, prompt + completion.token_ids)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            check(out.prompt_logprobs[i], prompt[i], ref[i - 1])
        assert completion.logprobs is not None and len(completion.logprobs) == MAX_TOKENS
        for j, token in enumerate(completion.token_ids):
            check(completion.logprobs[j], token, ref[len(prompt) + j - 1])
            assert completion.logprobs[j][token].decoded_token is not None
