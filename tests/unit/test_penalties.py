"""Penalties, logit bias, allowed token ids, bad words and prompt truncation (engine/penalties.py)
on the tiny random Llama in fp32: repetition_penalty against transformers' generate, presence /
frequency penalties and logit_bias against a reference built here from transformers' raw logits
(greedy and seeded rows, n = 2, mixed in one batch with rows that set nothing), and the masks under
structured output on the tiny model with the SmolLM2 tokenizer."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from qworker.engine.penalties import bad_words_token_ids
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidParamsError
from tests.conftest import run_to_completion, tiny_engine

pytestmark = pytest.mark.timeout(180)

EOS = 2  # TINY_LLAMA's eos_token_id
MASK64 = 0xFFFF_FFFF_FFFF_FFFF


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return tiny_engine(tiny_llama, num_kv_blocks=128)


def prompts(seed: int, count: int, length: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    # A small alphabet, so prompts repeat tokens and the output meets prompt tokens again.
    return [[rng.randrange(3, 40) for _ in range(length)] for _ in range(count)]


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[list[int]]]:
    """Every request in one batch -> per request, each completion's token ids."""
    ids = [
        engine.add_request(f"p{i}", {"prompt_token_ids": p}, params) for i, (p, params) in enumerate(requests)
    ]
    outs = run_to_completion(engine)
    return [[c.token_ids for c in outs[i].outputs] for i in ids]


def hf_generate(hf_model, prompt: list[int], num_tokens: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def reference(hf_model, prompt: list[int], params: SamplingParams, seed: int | None) -> list[int]:
    """The tokens `params` gives, from transformers' raw logits of each prefix, with the
    adjustments written out token by token (not as qworker computes them) and the sampler's draw
    (argmax of softmax(logits / T) over Exp(1) noise from the completion's seeded generator)."""
    generator = torch.Generator().manual_seed(seed & MASK64) if seed is not None else None
    output: list[int] = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].float().clone()
        if len(output) < params.min_tokens:
            logits[EOS] = float("-inf")
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        if params.repetition_penalty != 1.0:
            for token in set(prompt + output):
                value = logits[token].item()
                logits[token] = (
                    value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
                )
        for token, count in Counter(output).items():
            logits[token] -= params.frequency_penalty * count + params.presence_penalty
        if params.is_greedy:
            token = int(logits.argmax())
        else:
            assert generator is not None
            probs = (logits / params.temperature).softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=generator)
            token = int((probs / noise).argmax())
        output.append(token)
    return output


def test_repetition_penalty_greedy_equals_transformers(engine, tiny_llama):
    batch = prompts(seed=3, count=3)
    requests = []
    for p in batch:
        for penalty in (1.0, 1.4, 0.7):
            requests.append(
                (p, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, repetition_penalty=penalty))
            )
    got = run(engine, requests)
    changed = 0
    for (prompt, params), (tokens,) in zip(requests, got, strict=True):
        kwargs = {} if params.repetition_penalty == 1.0 else {"repetition_penalty": params.repetition_penalty}
        assert tokens == hf_generate(tiny_llama, prompt, 12, **kwargs), params.repetition_penalty
    for i in range(0, len(got), 3):
        changed += got[i] != got[i + 1]
    assert changed, "a repetition penalty of 1.4 changed no output: the test would pass without it"


def test_presence_frequency_and_bias_equal_the_reference_in_a_mixed_batch(engine, tiny_llama):
    batch = prompts(seed=5, count=6)
    bias = {7: 4.0, 11: -3.0, 30: 2.5}
    settings = [
        SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.8),
        SamplingParams(temperature=0.0),  # no adjustment, in the same batch
        SamplingParams(
            temperature=0.9, seed=11, n=2, presence_penalty=-1.0, frequency_penalty=-0.6, logit_bias=bias
        ),
        SamplingParams(temperature=1.0, seed=12),  # seeded, no adjustment
        SamplingParams(
            temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={5: -100.0}
        ),
        SamplingParams(temperature=0.7, seed=-3, presence_penalty=2.0, logit_bias=bias),
    ]
    for params in settings:
        params.max_tokens = params.min_tokens = 10
    requests = list(zip(batch, settings, strict=True))
    got = run(engine, requests)
    plain = run(
        engine,
        [
            (p, SamplingParams(max_tokens=10, min_tokens=10, temperature=s.temperature, seed=s.seed))
            for p, s in requests
        ],
    )
    for (prompt, params), completions, unadjusted in zip(requests, got, plain, strict=True):
        assert len(completions) == params.n
        for index, tokens in enumerate(completions):
            assert tokens == reference(tiny_llama, prompt, params, params.child_seed(index)), (params, index)
        if params.adjusts_logits:
            assert completions[0] != unadjusted[0], f"{params} changed nothing: the reference proves nothing"
    assert 5 not in got[4][0]


def test_logit_bias_of_100_forces_its_token_and_min_tokens_holds(engine):
    batch = prompts(seed=8, count=3)
    requests = [
        (batch[0], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={"77": 100})),
        (
            batch[1],
            SamplingParams(
                max_tokens=6, temperature=1.0, seed=1, logit_bias={77: 100.0}, frequency_penalty=2.0
            ),
        ),
        # EOS forced by its bias, held off by min_tokens: exactly 4 tokens, then EOS ends it.
        (batch[2], SamplingParams(max_tokens=20, min_tokens=4, temperature=0.0, logit_bias={EOS: 100.0})),
    ]
    got = run(engine, requests)
    assert got[0][0] == [77] * 6
    assert got[1][0] == [77] * 6  # a frequency penalty of 2 per use cannot beat a bias of 100
    assert len(got[2][0]) in (4, 5) and EOS not in got[2][0][:4]
    assert got[2][0][4:] in ([], [EOS])


def test_allowed_token_ids_mask_every_other_token(engine):
    allowed = [9, 21, 33]
    batch = prompts(seed=9, count=2)
    got = run(
        engine,
        [
            (batch[0], SamplingParams(max_tokens=8, temperature=1.0, seed=4, allowed_token_ids=allowed)),
            (
                batch[1],
                SamplingParams(
                    max_tokens=8, temperature=0.0, allowed_token_ids=allowed, presence_penalty=2.0
                ),
            ),
            (batch[1], SamplingParams(max_tokens=8, temperature=0.0)),
        ],
    )
    assert set(got[0][0]) <= set(allowed) and set(got[1][0]) <= set(allowed)
    assert not set(got[2][0]) <= set(allowed)


def test_truncate_prompt_tokens_keeps_the_last_k(engine):
    prompt = prompts(seed=10, count=1, length=20)[0]
    got = run(
        engine,
        [
            (prompt, SamplingParams(max_tokens=6, temperature=0.0, truncate_prompt_tokens=5)),
            (prompt[-5:], SamplingParams(max_tokens=6, temperature=0.0)),
            (prompt, SamplingParams(max_tokens=6, temperature=0.0, truncate_prompt_tokens=-1)),
            (prompt, SamplingParams(max_tokens=6, temperature=0.0)),
        ],
    )
    assert got[0] == got[1] and got[2] == got[3]
    assert got[0] != got[3]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", "1"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {-1: 1}),
        ("logit_bias", {i: 1.0 for i in range(301)}),
        ("logit_bias", [1, 2]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -2]),
        ("bad_words", ["ok", " "]),
        ("bad_words", [3]),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
    ],
)
def test_out_of_range_values_name_their_field(field, value):
    with pytest.raises(InvalidParamsError) as raised:
        SamplingParams(**{field: value})
    assert str(raised.value).startswith(field)


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    for field, value in (("logit_bias", {256: 1.0}), ("allowed_token_ids", [3, 300])):
        with pytest.raises(InvalidParamsError, match=f"^{field} .* outside the vocabulary"):
            engine.add_request(None, {"prompt_token_ids": [3, 4]}, SamplingParams(**{field: value}))
    with pytest.raises(InvalidParamsError, match=r"^bad_words needs the model.s tokenizer"):
        engine.add_request(None, {"prompt_token_ids": [3, 4]}, SamplingParams(bad_words=["x"]))
    assert not engine.has_unfinished_requests()


# -- with a tokenizer: bad words, and the masks under structured output -----------------------


@pytest.fixture(scope="module")
def tokenized_engine(tmp_path_factory):
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine
    from qworker.testing.worker_kit import write_tiny_model_dir

    model_dir = write_tiny_model_dir(tmp_path_factory.mktemp("tiny_tok"))
    return LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)
    )


def text_run(engine, prompt: str, params: SamplingParams):
    request_id = engine.add_request(None, prompt, params)
    return run_to_completion(engine)[request_id].outputs[0]


def encode_of(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def contains(tokens: list[int], sequence: tuple[int, ...]) -> bool:
    n = len(sequence)
    return any(tuple(tokens[i : i + n]) == sequence for i in range(len(tokens) - n + 1))


def test_bad_words_ban_their_token_sequences(tokenized_engine):
    tokenizer = tokenized_engine.tokenizer
    prompt = "The weather today is"
    free = text_run(tokenized_engine, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    # One word of one token and one of two, both taken from the free run's own output.
    single = tokenizer.decode([free.token_ids[0]])
    pair = tokenizer.decode(free.token_ids[2:4])
    words = [single, pair]

    sequences = bad_words_token_ids(words, encode_of(tokenizer), tokenized_engine.model_config.vocab_size)
    assert any(contains(free.token_ids, s) for s in sequences), "the free run holds no banned sequence"
    banned = text_run(
        tokenized_engine,
        prompt,
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=words),
    )
    assert not any(contains(banned.token_ids, s) for s in sequences)
    assert len(banned.token_ids) == 12


def test_bad_words_and_allowed_token_ids_under_structured_output(tokenized_engine):
    tokenizer = tokenized_engine.tokenizer
    choices = ["apple pie", "banana split", "cherry tart"]
    prompt = "Dessert:"
    free = text_run(
        tokenized_engine,
        prompt,
        SamplingParams(max_tokens=10, temperature=0.0, structured_outputs={"choice": choices}),
    )
    assert free.text in choices
    # Ban the grammar's first token, as a word: the grammar must take another path (bad words
    # ban token sequences, so another spelling of the same text stays possible).
    word = tokenizer.decode(free.token_ids[:1])
    sequences = bad_words_token_ids([word], encode_of(tokenizer), tokenized_engine.model_config.vocab_size)
    assert any(contains(free.token_ids, s) for s in sequences)
    avoided = text_run(
        tokenized_engine,
        prompt,
        SamplingParams(
            max_tokens=10, temperature=0.0, structured_outputs={"choice": choices}, bad_words=[word]
        ),
    )
    assert avoided.text in choices
    assert not any(contains(avoided.token_ids, s) for s in sequences)
    # allowed_token_ids holding only another choice's tokens (and EOS) pick that choice.
    target = next(c for c in choices if c != free.text)
    allowed = [*tokenizer.encode(target, add_special_tokens=False), *tokenized_engine.eos_token_ids]
    forced = text_run(
        tokenized_engine,
        prompt,
        SamplingParams(
            max_tokens=10, temperature=0.0, structured_outputs={"choice": choices}, allowed_token_ids=allowed
        ),
    )
    assert forced.text == target
    # A regex, with a bias toward one digit and the others banned as words.
    digits = text_run(
        tokenized_engine,
        prompt,
        SamplingParams(
            max_tokens=6,
            temperature=0.0,
            structured_outputs={"regex": "[0-9]{3}"},
            bad_words=["1", "2", "3"],
            logit_bias={tokenizer.convert_tokens_to_ids("7"): 30.0},
        ),
    )
    assert len(digits.text) == 3 and digits.text.isdigit() and not set("123") & set(digits.text)
    assert "7" in digits.text
