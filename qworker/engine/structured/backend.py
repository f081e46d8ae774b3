"""The grammar backend seam: compile a constraint for a tokenizer, and give each completion its
own matcher. llguidance is the backend (Earley parser over derivative-based lexers: no
backtracking, millisecond compiles, CPU only); it is imported when the first constrained request
arrives, so the engine runs without it. Another backend (xgrammar) is one more class with the
same two methods.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np

from qworker.engine.structured.closed_objects import close_objects
from qworker.engine.structured.spec import StructuredOutputError, StructuredOutputs


class Matcher(Protocol):
    """One completion's position in its grammar (llguidance's LLMatcher has these methods)."""

    def consume_token(self, token_id: int) -> bool: ...
    def is_stopped(self) -> bool: ...
    def is_accepting(self) -> bool: ...
    def is_error(self) -> bool: ...
    def get_error(self) -> str: ...
    def rollback(self, num_tokens: int) -> bool: ...


class CompiledGrammar(Protocol):
    """A constraint compiled for one tokenizer; cheap to start matchers from."""

    def new_matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile, or raise StructuredOutputError naming the problem. Runs off the step thread."""
        ...

    def fill_masks(self, matchers: list[Matcher], bitmask: np.ndarray) -> None:
        """bitmask: [len(matchers), words] int32; row i gets matcher i's allowed next tokens
        (bit j of word w allows token 32 * w + j)."""
        ...

    def consume(self, pairs: list[tuple[Matcher, int]]) -> list[bool]:
        """Advance each matcher by its token; False where the grammar refuses it."""
        ...


class _LLGuidanceGrammar:
    def __init__(self, template: Any) -> None:
        # Never advanced: every matcher is a copy of its start state (a copy takes ~5 us).
        self._template = template

    def new_matcher(self) -> Matcher:
        return self._template.deep_copy()


class LLGuidanceBackend:
    """llguidance over a Hugging Face fast tokenizer. Building the backend's tokenizer takes
    about a second (SmolLM2's 49,152 tokens), so it is built once, by the first compile.

    `disable_additional_properties`: close JSON objects (closed_objects.py) for specs that do not
    say; llguidance's JSON compiler has no switch for it, so the schema is rewritten first."""

    name = "llguidance"

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        disable_additional_properties: bool = True,
    ) -> None:
        self.disable_additional_properties = disable_additional_properties
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: Any = None
        self._executor: Any = None

    def _llg(self) -> Any:
        try:
            import llguidance
        except ImportError as exc:  # the engine itself runs without it
            raise StructuredOutputError(
                "structured_outputs needs the llguidance package, which is not installed here"
            ) from exc
        return llguidance

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            llg = self._llg()
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
            )
            # One thread per core at most; the masks of a 64-row batch take ~1 ms each.
            self._executor = llg.LLExecutor()
        return self._tokenizer

    def closes_objects(self, spec: StructuredOutputs) -> bool:
        """Whether `spec`'s JSON objects are closed (its own option, else this backend's)."""
        closing = spec.disable_additional_properties
        return spec.json is not None and (
            closing if closing is not None else self.disable_additional_properties
        )

    def grammar_text(self, spec: StructuredOutputs, *, close: bool | None = None) -> str:
        """The backend's own grammar for `spec` (llguidance JSON), or StructuredOutputError.
        `close`: close JSON objects (None: as closes_objects says)."""
        llg = self._llg()
        LLMatcher = llg.LLMatcher
        try:
            if spec.json is not None:
                options: dict[str, Any] = {}
                if spec.disable_any_whitespace:
                    options["whitespace_flexible"] = False
                if spec.whitespace_pattern is not None:
                    options["whitespace_pattern"] = spec.whitespace_pattern
                schema = spec.json
                if close if close is not None else self.closes_objects(spec):
                    schema = close_objects(schema)
                return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options or None)
            if spec.regex is not None:
                return LLMatcher.grammar_from_regex(spec.regex)
            if spec.choice is not None:
                lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice)
                return LLMatcher.grammar_from_lark(lark)
            assert spec.grammar is not None, "a spec has exactly one constraint"
            return llg.grammar_from("grammar", spec.grammar)
        except (ValueError, RuntimeError) as exc:
            raise StructuredOutputError(f"structured_outputs.{spec.kind}: {exc}") from None

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """A schema that closing makes unsatisfiable (a required property named only in an
        `allOf` branch, say) compiles as written instead, so closing never refuses a schema the
        backend accepts as written."""
        try:
            return self._compile(spec, close=self.closes_objects(spec))
        except StructuredOutputError:
            if not self.closes_objects(spec):
                raise
            return self._compile(spec, close=False)

    def _compile(self, spec: StructuredOutputs, *, close: bool) -> CompiledGrammar:
        llg = self._llg()
        tokenizer = self._ll_tokenizer()
        grammar = self.grammar_text(spec, close=close)
        # The default limits bound lexer fuel and Earley items, which is what keeps a
        # catastrophic regex or an enormous schema to bounded time; verbose_errors=False keeps
        # the parser's internals out of messages that reach users.
        limits = llg.LLParserLimits(verbose_errors=False)
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise StructuredOutputError(
                f"structured_outputs.{spec.kind} was refused by the grammar backend: {matcher.get_error()}"
            )
        return _LLGuidanceGrammar(matcher)

    def fill_masks(self, matchers: list[Matcher], bitmask: np.ndarray) -> None:
        assert bitmask.dtype == np.int32 and bitmask.flags.c_contiguous, "bitmask must be contiguous int32"
        assert bitmask.shape[0] >= len(matchers), f"{bitmask.shape[0]} mask rows for {len(matchers)} matchers"
        if not matchers:
            return
        self._ll_tokenizer()
        row_bytes = bitmask.shape[1] * 4
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, row_bytes, bitmask.shape[0]
        )

    def consume(self, pairs: list[tuple[Matcher, int]]) -> list[bool]:
        if not pairs:
            return []
        self._ll_tokenizer()
        return list(self._executor.consume_token_par(pairs))
