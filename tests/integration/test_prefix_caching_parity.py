"""Prefix caching changes no token: the real SmolLM2-135M-Instruct in float32, the cache on against
the cache off.

For configurations of the greedy parity tests (defaults, a token budget of 8, a pool small enough
to preempt, requests joining mid-decode) an engine with the cache on runs the parity prompts
twice: the first round from an empty cache, the second finding every prompt cached up to its last
block. Both must give the tokens of one uncached run. The defaults run the 11 prompts up to 423
tokens (27 blocks); the other configurations the parity tests' few that cross their boundary
(SHORT_SET, JOIN_SET). The prompt of over 1,000 tokens is left to the parity tests: its 65
blocks are cached and hit as the 423-token prompt's 27 are. Then prompts built to share a prefix
with an earlier one exactly up to a block boundary, one token past it, one token short of it, and
in full, at block sizes 1, 16 and 32; and a seeded sampled request, cached or not.

Two module engines serve most tests: one with the cache off (every reference) and one with it on
at the default block size and pool; a test on the cached one starts from an emptied cache, at its
own token budget. Only the small pool and block sizes 1 and 32 build engines of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from qworker import LLM, SamplingParams
from tests.conftest import run_with_staggered_arrivals
from tests.integration.test_parity_smollm2 import (
    CHATS,
    JOIN_SET,
    LONGEST,
    MAX_TOKENS,
    PARAGRAPH,
    RAW_PROMPTS,
    SHORT_SET,
    pick,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from qworker.model.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2").path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    """The greedy parity tests' 12 prompts, raw and chat-formatted, from 1 to over 1,000 tokens;
    only the one of over 1,000 (index LONGEST) is never run here."""
    raw = [tokenizer.encode(p, add_special_tokens=False) for p in RAW_PROMPTS]
    chats = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in CHATS]
    ids = raw + [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats]
    assert len(ids[LONGEST]) > 1000
    return ids


# Every prompt but the one of over 1,000 tokens: 1 to 423 tokens, raw and chat.
ALL_BUT_LONGEST = tuple(i for i in range(len(RAW_PROMPTS) + len(CHATS)) if i != LONGEST)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(**engine_args) -> LLM:
    engine_args.setdefault("num_kv_blocks", 400)
    return LLM("smollm2", dtype="float32", **engine_args)


@pytest.fixture(scope="module")
def uncached_llm() -> LLM:
    return make_llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached_llm() -> LLM:
    """Block size 16, 400 blocks, budget 2048, the cache on: the defaults of the parity tests."""
    return make_llm()


def empty_prefix_cache(llm: LLM) -> None:
    """Evict every cached block (nothing in flight): the next request finds nothing, as on a new
    engine. Taking every free block evicts the cached ones; giving them back frees them uncached."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    pool = engine.scheduler.kv_cache_manager.block_pool
    pool.free(pool.allocate(pool.num_free_blocks))
    assert engine.kv_stats().num_cached_blocks == 0


@contextmanager
def cold_at_budget(llm: LLM, budget: int | None = None) -> Iterator[LLM]:
    """The engine with an empty cache and (if given) another token budget, restored after."""
    empty_prefix_cache(llm)
    scheduler = llm.llm_engine.scheduler
    previous = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = budget or previous
    try:
        yield llm
    finally:
        scheduler.max_num_batched_tokens = previous


@pytest.fixture(scope="module")
def expected(uncached_llm, prompt_ids) -> list[list[int]]:
    # One uncached run serves every configuration: the greedy parity tests show that all of them
    # give transformers' tokens, so they give the same tokens as each other. (The longest prompt,
    # never run here, gets an empty list.)
    got = iter(generate(uncached_llm, pick(prompt_ids, ALL_BUT_LONGEST)))
    return [[] if i == LONGEST else next(got) for i in range(len(prompt_ids))]


# Block sizes 1 and 32 are not repeated here: the boundary test below runs both (and 16) on this
# model, cache on against off with exact hit counts, and the tiny engine's cache on/off test in
# tests/unit/test_prefix_caching.py runs them too, one by one and all at once.
CONFIGS = [
    {},  # block size 16
    {"max_num_batched_tokens": 8},
    # 15 blocks of 16: SHORT_SET's prompts fill them exactly (1 + 1 + 8 + 3 + 2 blocks), so all
    # five are admitted at once, and the 13-token request's decode past 16 tokens finds no free
    # block. (14 admits four and preempts nothing: each of them then fits its 8 tokens.)
    {"num_kv_blocks": 15},
]


@pytest.mark.parametrize(
    "engine_args", CONFIGS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default"
)
def test_parity_prompts_twice_with_the_cache_equal_once_without(
    cached_llm, prompt_ids, expected, engine_args
):
    # As in the parity tests, the defaults run the most prompts; SHORT_SET (up to 116 tokens,
    # across chunks of 8 and blocks of 16) takes the chunked and preempted paths at a fifth of it.
    chosen = SHORT_SET if engine_args else ALL_BUT_LONGEST
    prompt_ids, expected = pick(prompt_ids, chosen), pick(expected, chosen)
    if "num_kv_blocks" in engine_args:
        context = cold_at_budget(make_llm(**engine_args))
    else:
        context = cold_at_budget(cached_llm, engine_args.get("max_num_batched_tokens"))
    with context as llm:
        engine = llm.llm_engine
        hits_before = engine.kv_stats().num_prefix_cache_hits
        computed_before = engine.scheduler.num_prompt_tokens_computed
        assert generate(llm, prompt_ids) == expected
        hits_first = engine.kv_stats().num_prefix_cache_hits
        computed_first = engine.scheduler.num_prompt_tokens_computed - computed_before
        assert generate(llm, prompt_ids) == expected
        stats = engine.kv_stats()
        block_size = engine.config.block_size
        if "num_kv_blocks" not in engine_args:
            # Nothing was evicted: round 2 hits every prompt up to the block of its last token.
            cap = sum((len(p) - 1) // block_size * block_size for p in prompt_ids)
            assert stats.num_prefix_cache_hits - hits_first == cap
            # Round 1 started cold: it computed every prompt token but what prompts admitted in
            # the same step shared.
            assert hits_first - hits_before < cap
        assert stats.num_prefix_cache_hits > hits_first
        computed_second = engine.scheduler.num_prompt_tokens_computed - computed_before - computed_first
        assert computed_second < computed_first
        if "num_kv_blocks" in engine_args:
            assert engine.scheduler.num_preemptions > 0
        assert stats.num_used_blocks == 0


def test_requests_join_mid_decode_with_the_cache(cached_llm, prompt_ids, expected):
    prompt_ids, expected = pick(prompt_ids, JOIN_SET), pick(expected, JOIN_SET)
    with cold_at_budget(cached_llm, 256) as llm:
        on = llm.llm_engine
        assert run_with_staggered_arrivals(on, prompt_ids, GREEDY, steps_between=2) == expected
        hits_first = on.kv_stats().num_prefix_cache_hits
        # Round 2 joins the same way, every prompt cached.
        assert run_with_staggered_arrivals(on, prompt_ids, GREEDY, steps_between=2) == expected
        assert on.kv_stats().num_prefix_cache_hits > hits_first


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
def uncached_boundary_tokens(uncached_llm, base_ids):
    """Greedy tokens of every boundary prompt set, cache off, at block size 16: without the cache
    the tokens do not depend on the block size (test_parity_smollm2's block sizes 1 and 32 give
    transformers' tokens), so one uncached engine serves block sizes 1, 16 and 32, in one batch."""
    prompt_sets = {b: boundary_prompts(base_ids, b) for b in (1, 16, 32)}
    tokens = iter(generate(uncached_llm, [p for prompts in prompt_sets.values() for p in prompts]))
    return {b: [next(tokens) for _ in prompts] for b, prompts in prompt_sets.items()}


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefixes_shared_up_to_a_block_boundary_one_past_one_short_and_whole(
    cached_llm, base_ids, uncached_boundary_tokens, block_size
):
    prompts = boundary_prompts(base_ids, block_size)
    expected = uncached_boundary_tokens[block_size]
    if block_size == 16:  # the module's cached engine: 6400 // 16 blocks
        llm = cached_llm
    else:
        llm = make_llm(block_size=block_size, num_kv_blocks=6400 // block_size)
    empty_prefix_cache(llm)
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


def test_seeded_sampling_is_the_same_cached_or_not(uncached_llm, cached_llm, base_ids):
    prompt = base_ids[:150]
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=7)
    expected = generate(uncached_llm, [prompt], sampled)
    with cold_at_budget(cached_llm) as llm:
        before = llm.llm_engine.kv_stats().num_prefix_cache_hits
        assert generate(llm, [prompt], sampled) == expected
        assert generate(llm, [prompt], sampled) == expected
        hits = llm.llm_engine.kv_stats().num_prefix_cache_hits - before
    assert hits == (len(prompt) - 1) // 16 * 16
