"""Token-exact greedy parity with transformers on the real SmolLM2-135M-Instruct, in float32.

Each engine configuration below (defaults, every prompt chunked, preemption, block sizes 1 and
32, requests joining mid-decode) must reproduce transformers' `generate` (8 tokens a prompt). The
defaults run all 12 prompts (raw and chat-formatted, from 1 to over 1,000 tokens); the other
configurations run a few of them that cross their boundary: SHORT_SET (1 to 116 tokens, 191 in
all: one prompt inside a single chunk and block, the others across chunks of 8 and blocks of 1,
16 and 32, raw and chat) and, for the requests joining mid-decode, the 423-token prompt that a
budget of 256 splits. The configurations that differ from the defaults only in their token budget
run on the module's one default engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from qworker import LLM, SamplingParams
from tests.conftest import run_with_staggered_arrivals

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press adapted from wine making. "
    "Before that, books were copied by hand, which made them rare and expensive. Within fifty years "
    "presses had spread to more than two hundred cities across Europe, and millions of volumes were "
    "in circulation. Scholars argue about how much the press caused the Reformation and the "
    "scientific revolution, but nobody doubts that cheap books changed who could read and what "
    "they could read. "
)

RAW_PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
    PARAGRAPH + "In one sentence, the main effect of the printing press was",
    PARAGRAPH * 4 + "To summarise the text above:",
    PARAGRAPH * 10 + "The most important date mentioned is",  # over 1,000 tokens
]
CHATS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": PARAGRAPH * 2 + "\nWho invented the printing press?"}],
]
# The prompt of over 1,000 tokens (65 blocks, 131 chunks of 8): only the defaults run it.
LONGEST = 7
# Prompts of 1, 13 and 116 tokens (raw) and 37 and 24 (chat): one inside a chunk of 8 and a block,
# the rest across chunks and blocks (116 is 15 chunks of 8, 8 blocks of 16, 4 of 32).
SHORT_SET = (0, 3, 5, 8, 10)
# SHORT_SET without "Hi" and the 24-token chat, with the 423-token prompt and the 246-token chat:
# at a budget of 256 the 423-token one is prefilled in two chunks beside the decodes of those
# admitted before it.
JOIN_SET = (3, 5, 6, 8, 11)

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def prompt_ids():
    from transformers import AutoTokenizer

    from qworker.model.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2").path)
    raw = [tokenizer.encode(p, add_special_tokens=False) for p in RAW_PROMPTS]
    chats = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in CHATS]
    chats = [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats]
    ids = raw + chats
    assert len(ids) == 12
    assert max(len(p) for p in ids) == len(ids[LONGEST]) > 1000 and min(len(p) for p in ids) < 5
    return ids


def pick(items: list, indices: tuple[int, ...]) -> list:
    return [items[i] for i in indices]


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    from qworker.model.loader import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("smollm2").path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(prompt_ids, hf_smollm2):
    model = hf_smollm2
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    """Every default but the pool: block size 16, budget 2048, the prefix cache on."""
    return LLM("smollm2", dtype="float32", num_kv_blocks=400)


@contextmanager
def budget_without_the_cache(llm: LLM, budget: int) -> Iterator[None]:
    """The default engine at another token budget, prefix-cache lookups and entries off (so that
    no prompt starts from what an earlier test cached), both restored after."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    scheduler, kv = engine.scheduler, engine.scheduler.kv_cache_manager
    previous = scheduler.max_num_batched_tokens, kv.enable_prefix_caching
    scheduler.max_num_batched_tokens, kv.enable_prefix_caching = budget, False
    try:
        yield
    finally:
        scheduler.max_num_batched_tokens, kv.enable_prefix_caching = previous


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def test_a_all_at_once_defaults(default_llm, prompt_ids, expected):
    assert generate(default_llm, prompt_ids) == expected


def test_b_every_prompt_chunked(default_llm, prompt_ids, expected):
    with budget_without_the_cache(default_llm, 8):
        computed_before = default_llm.llm_engine.scheduler.num_prompt_tokens_computed
        assert generate(default_llm, pick(prompt_ids, SHORT_SET)) == pick(expected, SHORT_SET)
        computed = default_llm.llm_engine.scheduler.num_prompt_tokens_computed - computed_before
    assert computed == sum(len(p) for p in pick(prompt_ids, SHORT_SET)), "a prompt came from the cache"


def test_c_preemption(prompt_ids, expected):
    # 15 blocks of 16: SHORT_SET's prompts fill them exactly (1 + 1 + 8 + 3 + 2 blocks), so all
    # five are admitted at once, and the 13-token request's decode past 16 tokens finds no free
    # block. (14 admits four and preempts nothing: each of them then fits its 8 tokens.)
    llm = LLM("smollm2", dtype="float32", num_kv_blocks=15)
    assert generate(llm, pick(prompt_ids, SHORT_SET)) == pick(expected, SHORT_SET)
    assert llm.llm_engine.scheduler.num_preemptions > 0


# 16 is the default block size, and 6400 // 16 is the default engine's 400 blocks: test_a is that
# case.
@pytest.mark.parametrize("block_size", [1, 32])
def test_d_block_sizes(prompt_ids, expected, block_size):
    llm = LLM("smollm2", dtype="float32", block_size=block_size, num_kv_blocks=6400 // block_size)
    assert generate(llm, pick(prompt_ids, SHORT_SET)) == pick(expected, SHORT_SET)


def test_e_requests_join_mid_decode(default_llm, prompt_ids, expected):
    # At a budget of 256 the 423-token prompt is prefilled in two chunks beside the decodes.
    with budget_without_the_cache(default_llm, 256):
        got = run_with_staggered_arrivals(
            default_llm.llm_engine, pick(prompt_ids, JOIN_SET), GREEDY, steps_between=2
        )
    assert got == pick(expected, JOIN_SET)


def test_text_and_chat_api(default_llm, expected):
    llm = default_llm
    tokenizer = llm.get_tokenizer()
    out = llm.generate(RAW_PROMPTS[1], GREEDY)[0]
    assert out.outputs[0].token_ids == expected[1]
    assert out.outputs[0].text == tokenizer.decode(expected[1], skip_special_tokens=True)
    chat = llm.chat(CHATS[0], GREEDY)[0]
    assert chat.outputs[0].token_ids == expected[8]
    assert chat.metrics.arrival_time <= chat.metrics.first_token_time <= chat.metrics.finished_time


def test_repetition_penalty_equals_transformers(default_llm, prompt_ids, expected, hf_smollm2):
    """vLLM's repetition_penalty is transformers' (over the prompt and the output): greedy tokens
    equal `generate(repetition_penalty=...)`'s, for a penalty above 1 and one below, in one batch
    (one short prompt, 8 tokens: transformers' generate is most of the cost)."""
    num_tokens = MAX_TOKENS
    requests = [(prompt_ids[3], r) for r in (1.3, 0.85)]
    outs = default_llm.generate(
        [{"prompt_token_ids": p} for p, _ in requests],
        [SamplingParams(max_tokens=num_tokens, temperature=0.0, repetition_penalty=r) for _, r in requests],
    )
    got = [out.outputs[0].token_ids for out in outs]
    for (ids, penalty), tokens in zip(requests, got, strict=True):
        with torch.no_grad():
            gen = hf_smollm2.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=num_tokens,
                do_sample=False,
                repetition_penalty=penalty,
            )
        assert tokens == gen[0, len(ids) :].tolist(), penalty
    assert any(tokens != expected[3] for tokens in got), "the penalties changed no output"
