"""The engine continuing a request from output tokens an earlier run generated (engine/resume.py):
the same token ids as an uninterrupted run, greedy and seeded, only new tokens emitted, the stop
rules counting the resumed tokens, and refusals for tokens it cannot continue from. Tiny random
Llama on the CPU in float32; the text checks use the SmolLM2 tokenizer on a tiny model of its
vocabulary."""

from __future__ import annotations

import pytest
import torch

from qworker.engine.resume import ResumeFrom
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import ResumeRefusedError
from tests.conftest import tiny_engine, tiny_hf_model

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 17, 33, 9, 120, 44, 3]
OTHER_PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_llama):
    # Block size 4: the resumed prefill spans several blocks, and a second resume of the same
    # prompt hits the prefix cache.
    return tiny_engine(tiny_llama, num_kv_blocks=128, block_size=4)


def run(engine, request_id, prompt, params, resume=None, other=None):
    """Run one request (beside `other`, a second prompt, when given) to its end: (final output,
    the token ids its step outputs carried)."""
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, resume=resume)
    if other is not None:
        engine.add_request(f"{request_id}-other", {"prompt_token_ids": other}, params)
    emitted: list[int] = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                emitted.extend(out.new_token_ids)
                if out.finished:
                    final = out.output
    assert final is not None
    assert engine.kv_stats().num_used_blocks == 0
    return final, emitted


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_resume_gives_the_uninterrupted_tokens(engine, params) -> None:
    reference, emitted = run(engine, "ref", PROMPT, params)
    tokens = reference.outputs[0].token_ids
    assert emitted == tokens and len(tokens) == NUM_TOKENS
    for k in (1, 5, 13, NUM_TOKENS - 1):
        # Beside another request, so that the resumed prefill shares its step with a decode.
        final, emitted = run(
            engine, f"resumed-{k}", PROMPT, params, ResumeFrom(tokens[:k]), other=OTHER_PROMPT
        )
        assert final.outputs[0].token_ids == tokens, k
        assert emitted == tokens[k:], k  # the resumed tokens are not emitted again
        assert final.outputs[0].finish_reason == "length"
        assert final.prompt_token_ids == PROMPT  # prompt tokens once


def test_seeded_resume_skips_the_draws_made(engine) -> None:
    """The uninterrupted seeded run's tokens are what they were before resume existed: the
    generator of a fresh request is not touched; only a resumed one skips its earlier draws."""
    reference, _ = run(engine, "seeded-ref", PROMPT, SEEDED)
    again, _ = run(engine, "seeded-again", PROMPT, SEEDED)
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
    tokens = reference.outputs[0].token_ids
    # Without the skip the resumed request would draw its first noise again: another token.
    from qworker.engine import runner as runner_module

    real_skip = runner_module.skip_draws
    runner_module.skip_draws = lambda *args: None
    try:
        unskipped, _ = run(engine, "seeded-unskipped", PROMPT, SEEDED, ResumeFrom(tokens[:8]))
    finally:
        runner_module.skip_draws = real_skip
    assert unskipped.outputs[0].token_ids != tokens


def test_resumed_tokens_count_toward_min_and_max_tokens(engine) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reference, _ = run(engine, "short-ref", PROMPT, params)
    tokens = reference.outputs[0].token_ids
    final, emitted = run(engine, "short", PROMPT, params, ResumeFrom(tokens[:7]))
    assert final.outputs[0].token_ids == tokens and emitted == tokens[7:]
    # A stop id the run meets after the cut ends it there, as it did the uninterrupted run.
    cut = 7
    first_new = next(j for j in range(cut, len(tokens)) if tokens[j] not in tokens[:j])
    stopping = SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[first_new]]
    )
    final, _ = run(engine, "stop-id", PROMPT, stopping, ResumeFrom(tokens[:cut]))
    assert final.outputs[0].token_ids == tokens[: first_new + 1]
    assert final.outputs[0].finish_reason == "stop"
    # Below min_tokens a stop id among the resumed tokens did not end the run: accepted.
    early = SamplingParams(
        max_tokens=10, min_tokens=9, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[2]]
    )
    final, _ = run(engine, "below-min", PROMPT, early, ResumeFrom(tokens[:3]))
    assert final.outputs[0].token_ids[:3] == tokens[:3]


@pytest.mark.parametrize(
    ("params", "tokens", "reason"),
    [
        (GREEDY, list(range(10, 10 + NUM_TOKENS)), "reach max_tokens"),
        (GREEDY, list(range(10, 10 + NUM_TOKENS + 5)), "reach max_tokens"),
        (SamplingParams(max_tokens=20, temperature=0.0), [10, 11, 2, 12], "is a stop"),
        (SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[11]), [10, 11, 12], "is a stop"),
        (GREEDY, [10, 999, 12], "outside the vocabulary"),
        (GREEDY, [10, -1], "outside the vocabulary"),
        (GREEDY, [10, "x"], "not a token id"),
        (SamplingParams(max_tokens=20, n=2, seed=1), [10, 11], "n > 1"),
        (SamplingParams(max_tokens=20, logprobs=2), [10, 11], "logprobs"),
        (
            SamplingParams(max_tokens=1000, temperature=0.0),
            [*range(3, 253), *range(3, 253), *range(3, 9)],
            "context",
        ),
    ],
    ids=[
        "max-tokens",
        "past-max-tokens",
        "eos",
        "stop-id",
        "vocab",
        "negative",
        "not-int",
        "n",
        "logprobs",
        "context",
    ],
)
def test_tokens_it_cannot_continue_from_are_refused(engine, params, tokens, reason) -> None:
    with pytest.raises(ResumeRefusedError, match=reason):
        engine.add_request("refused", {"prompt_token_ids": PROMPT}, params, resume=ResumeFrom(tokens))
    assert not engine.has_unfinished_requests()
    assert "refused" not in engine.output_processor
    # The same request from zero is accepted.
    if params.max_tokens <= NUM_TOKENS:
        final, _ = run(engine, "refused", PROMPT, params)
        assert final.finished


def test_eos_before_min_tokens_does_not_refuse(engine) -> None:
    params = SamplingParams(max_tokens=12, min_tokens=5, temperature=0.0)
    engine.add_request("early-eos", {"prompt_token_ids": PROMPT}, params, resume=ResumeFrom([10, 2, 11]))
    engine.abort("early-eos")


# -- text ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_engine():
    from qworker.config import EngineConfig
    from qworker.engine.llm_engine import LLMEngine
    from qworker.model.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2").path)
    model = tiny_hf_model("llama", vocab_size=49152, tie_word_embeddings=True)
    config = EngineConfig(model="tiny-text", dtype="float32", device="cpu", num_kv_blocks=64, block_size=16)
    return LLMEngine(config, hf_config=model.config, state_dict=model.state_dict(), tokenizer=tokenizer)


def run_text(engine, request_id, prompt, params, resume=None):
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, resume=resume)
    deltas = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.text_delta)
            if out.finished:
                final = out.output
    return final, "".join(deltas)


def test_resumed_text_continues_what_was_streamed(text_engine) -> None:
    """The text the resumed request emits, after the text streamed for its resumed tokens, is the
    uninterrupted text: no repeat, no gap, whatever the detokenizer held back at the cut (the
    stop string's possible start, a partial character)."""
    prompt = text_engine.tokenize("Once upon a time")[1]
    params = SamplingParams(max_tokens=20, seed=5, temperature=1.0, ignore_eos=True, stop=["zzzzzz"])
    reference, streamed = run_text(text_engine, "text-ref", prompt, params)
    tokens = reference.outputs[0].token_ids
    assert streamed == reference.outputs[0].text
    for k in (1, 4, 11):
        # What the earlier run had streamed when it had k tokens (its hold-back kept back).
        before = _streamed_after(text_engine, prompt, params, tokens[:k])
        final, after = run_text(text_engine, f"text-{k}", prompt, params, ResumeFrom(tokens[:k], before))
        assert final.outputs[0].token_ids == tokens
        assert before + after == reference.outputs[0].text, k
        assert final.outputs[0].text == reference.outputs[0].text


def _streamed_after(engine, prompt, params, tokens) -> str:
    """The text an uninterrupted run streams by the time it has `tokens`."""
    from qworker.engine.detokenizer import IncrementalDetokenizer

    detokenizer = IncrementalDetokenizer(
        engine.tokenizer, prompt, params.stop, params.include_stop_str_in_output
    )
    text = ""
    for token_id in tokens:
        detokenizer.update(token_id)
        text += detokenizer.take_delta(False)
    return text


def test_text_that_does_not_match_its_tokens_is_refused(text_engine) -> None:
    prompt = text_engine.tokenize("Hello")[1]
    tokens = text_engine.tokenize(" world, this is a test")[1]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with pytest.raises(ResumeRefusedError, match="not what its"):
        text_engine.add_request(
            "bad-text", {"prompt_token_ids": prompt}, params, resume=ResumeFrom(tokens, "elsewhere")
        )
    stopping = SamplingParams(max_tokens=30, temperature=0.0, stop=["this"])
    with pytest.raises(ResumeRefusedError, match="stop string"):
        text_engine.add_request(
            "stop-text", {"prompt_token_ids": prompt}, stopping, resume=ResumeFrom(tokens)
        )
    assert not text_engine.has_unfinished_requests()


def test_skip_draws_is_the_sampler_draw() -> None:
    """skip_draws leaves a generator where the sampler's draws of as many tokens leave it."""
    from qworker.engine.sampler import Sampler, SamplingRow, skip_draws

    sampler = Sampler((2,))
    params = SamplingParams(temperature=1.0, seed=3)
    drawn = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 300)
    for _ in range(7):
        sampler.sample(logits.clone(), [SamplingRow(params, 0, drawn)])
    skipped = torch.Generator().manual_seed(3)
    skip_draws(skipped, 7, 300, torch.device("cpu"))
    assert torch.equal(drawn.get_state(), skipped.get_state())
