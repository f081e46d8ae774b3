from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from qworker.config import MAX_SEED, MIN_SEED
from qworker.engine.structured.spec import StructuredOutputs
from qworker.errors import InvalidParamsError

# Far past any context we can hold; rejects absurd values early with a clear message. A request
# still ends at the model's context (finish_reason "length"), whatever max_tokens says.
MAX_TOKENS_LIMIT = 1_000_000
# Temperatures between 0 and this are raised to it, as vLLM does: dividing float32 logits by a
# smaller one overflows to inf, and the softmax of a row with infs is NaN.
MIN_SAMPLING_TEMPERATURE = 1e-2
# Bounds on the per-request fan-out and on the alternatives reported per position (vLLM's
# default max_logprobs is 20, as is OpenAI's top_logprobs limit).
MAX_N = 128
MAX_LOGPROBS = 20
# OpenAI's bounds: presence and frequency penalties in [-2, 2]; logit_bias values in [-100, 100],
# at most 300 entries.
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
# Bounds that keep one request's per-step work small (vLLM has none): banned words and the
# length of each, in characters.
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 200


def _as_float(name: str, value: object) -> float:
    """`value` as a finite float, or InvalidParamsError naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParamsError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise InvalidParamsError(f"{name} must be a finite number, got {value}") from None
    if not math.isfinite(number):
        raise InvalidParamsError(f"{name} must be a finite number, got {value!r}")
    return number


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling parameters, with vLLM's field names and meanings.

    temperature=0 is greedy; a temperature between 0 and 0.01 is raised to 0.01 (as vLLM does).
    top_k=0 or -1 (as in vLLM) means no top-k cut, and a top_k above the vocabulary cuts nothing.
    A `seed` (a signed 64-bit integer) makes the request's random draws depend only on itself,
    whatever else shares the batch.

    `n` completions of one prompt share its KV blocks; completion i samples with a seed derived
    from (seed, i) (`child_seed`). `logprobs=k` reports, per generated token, the sampled
    token's logprob and rank plus the top k alternatives; `prompt_logprobs=k` the same per
    prompt token. Logprobs are raw: log_softmax of the model's logits before the grammar mask,
    the logit adjustments below, temperature, top-k, top-p and min-p (vLLM's default
    `logprobs_mode="raw_logprobs"`), so they do not depend on the sampling settings.

    Logit adjustments (vLLM's meanings, OpenAI's ranges; the math is engine/penalties.py):
    `presence_penalty` and `frequency_penalty` (in [-2, 2]) subtract p * [token occurred] and
    f * count(token) over the generated tokens; `repetition_penalty` (> 0, 1 is off) divides the
    positive logits and multiplies the negative ones of every token in the prompt or the output
    (transformers' RepetitionPenaltyLogitsProcessor); `logit_bias` adds a value in [-100, 100] to
    up to 300 token ids; `allowed_token_ids` masks every other token; `bad_words` bans each
    word's token sequence (its last token is masked where the output ends with the others),
    tokenized with and without a leading space. `truncate_prompt_tokens=k` keeps the prompt's
    last k tokens (-1: as many as the context allows with one generated token). A greedy row
    takes the argmax of the adjusted logits.

    `structured_outputs` constrains the output to a JSON Schema, a regex, a list of choices or a
    grammar (`StructuredOutputs`; a dict with its fields is converted, and an unknown key or a
    second constraint is an error). See docs/structured_output.md.

    The checks here depend on the values alone. Those that depend on the model (token ids within
    its vocabulary) run when a request enters the engine: `check_model_limits`.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # A dict (a job's JSON) becomes StructuredOutputs in __post_init__.
    structured_outputs: dict[str, Any] | StructuredOutputs | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias; a job's JSON keys are strings of ids, made ints in __post_init__.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.from_value(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(message: str) -> InvalidParamsError:
            return InvalidParamsError(message)

        if not _is_int(self.max_tokens):
            raise bad(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_tokens > MAX_TOKENS_LIMIT:
            raise bad(f"max_tokens must be at most {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        # Floats from here on: the sampler puts them in tensors, where a huge int would overflow.
        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if 0.0 < self.temperature < MIN_SAMPLING_TEMPERATURE:
            self.temperature = MIN_SAMPLING_TEMPERATURE
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise bad(f"seed must be an integer in [-2**63, 2**63 - 1] or None, got {self.seed!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be a list of non-negative integers")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._validate_logit_adjustments()

    def _validate_logit_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise InvalidParamsError(f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, value)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise InvalidParamsError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids or any(not _is_int(t) or t < 0 for t in ids):
                raise InvalidParamsError(
                    f"allowed_token_ids must be a non-empty list of non-negative integers, got {ids!r}"[:300]
                )
            self.allowed_token_ids = list(ids)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidParamsError(
                f"bad_words has {len(self.bad_words)} words; the limit is {MAX_BAD_WORDS}"
            )
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                raise InvalidParamsError(
                    f"bad_words must be a list of strings of 1-{MAX_BAD_WORD_CHARS} characters, "
                    f"not all whitespace, got {word!r}"[:300]
                )
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k >= 1 or k == -1)):
            raise InvalidParamsError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")

    def check_model_limits(self, vocab_size: int) -> None:
        """Raise InvalidParamsError for values this model cannot run: token ids outside its
        vocabulary (they would index past the logits)."""
        named = (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
        )
        for name, token_ids in named:
            outside = [t for t in token_ids if t >= vocab_size]
            if outside:
                raise InvalidParamsError(
                    f"{name} {outside[:5]} {'are' if len(outside) > 1 else 'is'} outside the "
                    f"vocabulary [0, {vocab_size})"
                )

    def child_seed(self, index: int) -> int | None:
        """The seed of completion `index` of n: the request's seed for completion 0, and for the
        others a signed 64-bit mix of (seed, index), so each completion has its own stream."""
        if self.seed is None or index == 0:
            return self.seed
        mixed = (self.seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
        mixed ^= mixed >> 31
        return mixed - 2**64 if mixed >= 2**63 else mixed

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """A presence, frequency or repetition penalty is set (they need the token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Any of the logit adjustments is set (engine/penalties.py applies them)."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )


def _logit_bias(value: object) -> dict[int, float]:
    """`value` (token id -> bias; ids as ints or as strings of ints, as JSON keys are) as a dict
    of int ids to float biases within OpenAI's bounds, or InvalidParamsError naming logit_bias."""
    if not isinstance(value, dict):
        raise InvalidParamsError(f"logit_bias must be an object of token id -> bias, got {value!r}"[:300])
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParamsError(
            f"logit_bias has {len(value)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}"
        )
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token_id = key
        if isinstance(key, str) and key.strip().isdecimal():
            token_id = int(key)
        if not _is_int(token_id) or token_id < 0:
            raise InvalidParamsError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}"[:300]
            )
        number = _as_float(f"logit_bias[{token_id}]", bias)
        if not -MAX_ABS_LOGIT_BIAS <= number <= MAX_ABS_LOGIT_BIAS:
            raise InvalidParamsError(f"logit_bias[{token_id}] must be in [-100, 100], got {number!r}")
        biases[token_id] = number
    return biases
