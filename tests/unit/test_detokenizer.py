"""The incremental detokenizer's text, through the Rust backend's decode, equals
tokenizer.decode's (SmolLM2's tokenizer: special tokens, multi-byte characters, stop strings)."""

from __future__ import annotations

import random

import pytest

from qworker.engine.detokenizer import IncrementalDetokenizer
from qworker.model.loader import load_tokenizer, resolve_model

pytestmark = pytest.mark.timeout(60)


class WrapperOnly:
    """The tokenizer behind its Python decode alone: the detokenizer's reference path."""

    clean_up_tokenization_spaces = True

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def texts(tokenizer, token_ids: list[int], stop: list[str], skip_special_tokens: bool) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop, False, skip_special_tokens)
    deltas = []
    for token_id in token_ids:
        found = detokenizer.update(token_id)
        deltas.append(detokenizer.take_delta(found is not None))
        if found is not None:
            break
    return [*deltas, detokenizer.output_text]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_gives_the_wrapper_text(skip_special_tokens) -> None:
    tokenizer = load_tokenizer(resolve_model("smollm2").path)
    assert tokenizer.backend_tokenizer is not None and not tokenizer.clean_up_tokenization_spaces
    rng = random.Random(0)
    prose = tokenizer.encode(
        "Héllo wörld — 日本語のテキスト, émojis 🎉🎉 and code: x = [1, 2]\n", add_special_tokens=False
    )
    for trial in range(20):
        # Random ids (special ones among them: 0-16) and real text, cut anywhere.
        token_ids = [
            rng.randrange(0, 49152) if rng.random() < 0.5 else rng.randrange(0, 17) for _ in range(20)
        ]
        token_ids = rng.sample(prose, k=len(prose)) if trial % 2 else [*token_ids, *prose]
        stop = ["wörld", "\n"] if trial % 3 == 0 else []
        assert texts(tokenizer, token_ids, stop, skip_special_tokens) == texts(
            WrapperOnly(tokenizer), token_ids, stop, skip_special_tokens
        )
