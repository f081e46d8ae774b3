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
    prompt token. Logprobs are raw: log_softmax of the model's logits before temperature,
    top-k, top-p and min-p (vLLM's default), so they do not depend on the sampling settings.

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

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.from_value(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
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

    def check_model_limits(self, vocab_size: int) -> None:
        """Raise InvalidParamsError for values this model cannot run: token ids outside its
        vocabulary (they would index past the logits)."""
        outside = [t for t in self.stop_token_ids if t >= vocab_size]
        if outside:
            raise InvalidParamsError(
                f"stop_token_ids {outside[:5]} {'are' if len(outside) > 1 else 'is'} outside the "
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
