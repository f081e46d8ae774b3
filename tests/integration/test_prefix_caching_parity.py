"""Prefix caching changes no token: the real SmolLM2-135M-Instruct in float32, the cache on against
the cache off.

For configurations of the greedy parity tests (defaults, a token budget of 8, a pool small enough
to preempt, requests joining mid-decode) an engine with the cache off runs the 12 parity prompts
once, and an engine with it on runs them twice: the second round finds every prompt cached up to
its last block. All three must agree token for token. Then prompts built to share a prefix with an
earlier one exactly up to a block boundary, one token past it, one token short of it, and in full,
at block sizes 1, 16 and 32; and a seeded sampled request, cached or not.
"""

from __future__ import annotations

import pytest

from qworker import LLM, SamplingParams
from tests.conftest import run_with_staggered_arrivals
from tests.integration.test_parity_smollm2 import CHATS, MAX_TOKENS, PARAGRAPH, RAW_PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from qworker.model.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2").path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    """The greedy parity tests' 12 prompts, raw and chat-formatted, from 3 to over 1,000 tokens."""
    raw = [tokenizer.encode(p, add_special_tokens=False) for p in RAW_PROMPTS]
    chats = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in CHATS]
    return raw + [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(**engine_args) -> LLM:
    engine_args.setdefault("num_kv_blocks", 400)
    return LLM("smollm2", dtype="float32", **engine_args)


@pytest.fixture(scope="module")
def expected(prompt_ids) -> list[list[int]]:
    # One uncached run serves every configuration: the greedy parity tests show that all of them
    # give transformers' tokens, so they give the same tokens as each other.
    return generate(make_llm(enable_prefix_caching=False), prompt_ids)


# Block sizes 1 and 32 are not repeated here: the boundary test below runs both (and 16) on this
# model, cache on against off with exact hit counts, and the tiny engine's cache on/off test in
# tests/unit/test_prefix_caching.py runs them too, one by one and all at once.
CONFIGS = [
    {},  # block size 16
    {"max_num_batched_tokens": 8},
    # 80 blocks of 16 = 1,280 slots: the longest request alone needs 70 of them. (With 90, the
    # prompts admitted together share their chat template's blocks and nothing is preempted.)
    {"num_kv_blocks": 80},
]


@pytest.mark.parametrize(
    "engine_args", CONFIGS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default"
)
def test_parity_prompts_twice_with_the_cache_equal_once_without(prompt_ids, expected, engine_args):
    keep = range(len(prompt_ids))
    if engine_args.get("max_num_batched_tokens") == 8:
        # The prompt of over 1,000 tokens alone is some 130 steps of 8 a round; the other 11 (up
        # to over 400 tokens, many blocks each) take the same chunked path through the cache.
        longest = max(keep, key=lambda i: len(prompt_ids[i]))
        keep = [i for i in keep if i != longest]
    prompt_ids = [prompt_ids[i] for i in keep]
    expected = [expected[i] for i in keep]
    llm = make_llm(**engine_args)
    engine = llm.llm_engine
    assert generate(llm, prompt_ids) == expected
    hits_first = engine.kv_stats().num_prefix_cache_hits
    computed_first = engine.scheduler.num_prompt_tokens_computed
    assert generate(llm, prompt_ids) == expected
    stats = engine.kv_stats()
    block_size = engine.config.block_size
    if "num_kv_blocks" not in engine_args or engine_args["num_kv_blocks"] >= 200:
        # Nothing was evicted: round 2 hits every prompt up to the block of its last token.
        cap = sum((len(p) - 1) // block_size * block_size for p in prompt_ids)
        assert stats.num_prefix_cache_hits - hits_first == cap
    assert stats.num_prefix_cache_hits > hits_first
    assert engine.scheduler.num_prompt_tokens_computed - computed_first < computed_first
    if engine_args.get("num_kv_blocks") == 80:
        assert engine.scheduler.num_preemptions > 0
    assert stats.num_used_blocks == 0


def test_requests_join_mid_decode_with_the_cache(prompt_ids, expected):
    on = make_llm(max_num_batched_tokens=256).llm_engine
    assert run_with_staggered_arrivals(on, prompt_ids, GREEDY, steps_between=2) == expected
    # Round 2 joins the same way, every prompt cached.
    assert run_with_staggered_arrivals(on, prompt_ids, GREEDY, steps_between=2) == expected
    assert on.kv_stats().num_prefix_cache_hits > 0


@pytest.fixture(scope="module")
def base_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(PARAGRAPH * 3, add_special_tokens=False)
    assert len(ids) > 200
    return ids


def boundary_prompts(base: list[int], block_size: int) -> list[list[int]]:
    """A seed prompt, then prompts that share with it exactly k blocks, one token more, one token
    fewer, exactly k blocks and nothing else (so the last block is recomputed), and all of it."""
    k = 96 // block_size * block_size
    question = base[3:11]  # any few tokens that do not continue the text where the prefix stops
    seed = base[:160] + question
    return [
        seed,
        base[:k] + question,
        base[: k + 1] + question,
        base[: k - 1] + question,
        base[:k],
        seed,
    ]


@pytest.fixture(scope="module")
def uncached_boundary_tokens(base_ids):
    """Greedy tokens of every boundary prompt set, cache off, at block size 16: without the cache
    the tokens do not depend on the block size (test_parity_smollm2's block sizes 1 and 32 give
    transformers' tokens), so one uncached engine serves block sizes 1, 16 and 32 (was one each)."""
    llm = make_llm(enable_prefix_caching=False, num_kv_blocks=400)
    return {b: generate(llm, boundary_prompts(base_ids, b)) for b in (1, 16, 32)}


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefixes_shared_up_to_a_block_boundary_one_past_one_short_and_whole(
    base_ids, uncached_boundary_tokens, block_size
):
    prompts = boundary_prompts(base_ids, block_size)
    args = {"block_size": block_size, "num_kv_blocks": 6400 // block_size}
    expected = uncached_boundary_tokens[block_size]
    llm = make_llm(**args)
    engine = llm.llm_engine
    got, hits = [], []
    for prompt in prompts:  # one at a time: each finds what the ones before left in the cache
        before = engine.kv_stats().num_prefix_cache_hits
        got.append(generate(llm, [prompt])[0])
        hits.append(engine.kv_stats().num_prefix_cache_hits - before)
    assert got == expected
    # What the cache held: every earlier request's computed tokens (its prompt and all its output
    # but the last token), in whole blocks; a hit stops at the block of the prompt's last token.
    computed = [p + out[:-1] for p, out in zip(prompts, expected, strict=True)]
    model_hits = [
        min(
            max((common_prefix_len(prompt, c) for c in computed[:i]), default=0) // block_size * block_size,
            (len(prompt) - 1) // block_size * block_size,
        )
        for i, prompt in enumerate(prompts)
    ]
    assert hits == model_hits
    k = 96 // block_size * block_size
    assert hits[1] >= k
    assert hits[4] == (k - 1) // block_size * block_size  # whole prompt cached: last block again
    assert hits[5] == (len(prompts[5]) - 1) // block_size * block_size


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_seeded_sampling_is_the_same_cached_or_not(base_ids):
    prompt = base_ids[:150]
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=7)
    expected = generate(make_llm(enable_prefix_caching=False), [prompt], sampled)
    llm = make_llm()
    assert generate(llm, [prompt], sampled) == expected
    assert generate(llm, [prompt], sampled) == expected
    assert llm.llm_engine.kv_stats().num_prefix_cache_hits == (len(prompt) - 1) // 16 * 16
