from __future__ import annotations

from dataclasses import dataclass, field

from qworker.errors import InvalidParamsError

# Far past any context we can hold; rejects absurd values early with a clear message.
MAX_TOKENS_LIMIT = 1_000_000


@dataclass
class SamplingParams:
    """Sampling parameters, with vLLM's field names and meanings.

    temperature=0 is greedy. top_k=0 or -1 (as in vLLM) means no top-k cut. A `seed` makes the
    request's random draws depend only on itself, whatever else shares the batch.
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

    def __post_init__(self) -> None:
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

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_tokens > MAX_TOKENS_LIMIT:
            raise bad(f"max_tokens must be at most {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be a list of non-negative integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
