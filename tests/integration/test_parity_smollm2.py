"""Token-exact greedy parity with transformers on the real SmolLM2-135M-Instruct, in float32.

Each engine configuration below (defaults, every prompt chunked, preemption, block sizes 1 to 32,
requests joining mid-decode) runs the same 12 prompts (raw and chat-formatted, from 3 to over
1,000 tokens) and must reproduce transformers' `generate`.
"""

from __future__ import annotations

import pytest
import torch

from qworker import LLM, SamplingParams
from tests.conftest import run_with_staggered_arrivals

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 20

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
    assert max(len(p) for p in ids) > 1000 and min(len(p) for p in ids) < 5
    return ids


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


def run(prompt_ids, **engine_args):
    llm = LLM("smollm2", dtype="float32", num_kv_blocks=engine_args.pop("num_kv_blocks", 400), **engine_args)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )
    return llm, [o.outputs[0].token_ids for o in outs]


def test_a_all_at_once_defaults(prompt_ids, expected):
    _, got = run(prompt_ids)
    assert got == expected


def test_b_every_prompt_chunked(prompt_ids, expected):
    _, got = run(prompt_ids, max_num_batched_tokens=8)
    assert got == expected


def test_c_preemption(prompt_ids, expected):
    # 80 blocks of 16 = 1,280 slots: the longest request alone needs 70 of them. (With 90, the
    # prompts admitted together share their chat template's blocks and nothing is preempted.)
    llm, got = run(prompt_ids, num_kv_blocks=80)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == expected


# 16 is the default block size, and 6400 // 16 is test_a's 400 blocks: test_a is that case.
@pytest.mark.parametrize("block_size", [1, 32])
def test_d_block_sizes(prompt_ids, expected, block_size):
    num_blocks = 6400 // block_size
    _, got = run(prompt_ids, block_size=block_size, num_kv_blocks=num_blocks)
    assert got == expected


def test_e_requests_join_mid_decode(prompt_ids, expected):
    llm = LLM("smollm2", dtype="float32", num_kv_blocks=400, max_num_batched_tokens=256)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    assert run_with_staggered_arrivals(engine, prompt_ids, params, steps_between=2) == expected


def test_text_and_chat_api(prompt_ids, expected):
    llm = LLM("smollm2", dtype="float32", num_kv_blocks=400)
    tokenizer = llm.get_tokenizer()
    out = llm.generate(RAW_PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    assert out.outputs[0].token_ids == expected[1]
    assert out.outputs[0].text == tokenizer.decode(expected[1], skip_special_tokens=True)
    chat = llm.chat(CHATS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    assert chat.outputs[0].token_ids == expected[8]
    assert chat.metrics.arrival_time <= chat.metrics.first_token_time <= chat.metrics.finished_time


def test_repetition_penalty_equals_transformers(prompt_ids, expected, hf_smollm2):
    """vLLM's repetition_penalty is transformers' (over the prompt and the output): greedy tokens
    equal `generate(repetition_penalty=...)`'s, for a penalty above 1 and one below, in one batch
    (two short prompts, 12 tokens: transformers' generate is most of the cost)."""
    num_tokens = 12
    requests = [(prompt_ids[i], r) for i in (1, 3) for r in (1.3, 0.85)]
    llm = LLM("smollm2", dtype="float32", num_kv_blocks=200)
    outs = llm.generate(
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
    unpenalized = [expected[1][:num_tokens], expected[3][:num_tokens]]
    assert any(tokens not in unpenalized for tokens in got), "the penalties changed no output"
