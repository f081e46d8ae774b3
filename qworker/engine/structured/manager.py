"""The engine's structured-output part: one backend and compiler per engine (both built when the
first constrained request arrives), and the requests waiting for their grammars."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qworker.engine.structured.backend import CompiledGrammar, LLGuidanceBackend
from qworker.engine.structured.compiler import CompileTicket, GrammarCompiler
from qworker.engine.structured.spec import StructuredOutputError, StructuredOutputs
from qworker.engine.structured.state import GrammarState

# Tokens fast-forwarded per request and step at most; the rest follow at the next step.
MAX_FAST_FORWARD_TOKENS = 64
# How long a step with nothing to run but compiles to wait for sleeps for one.
IDLE_COMPILE_WAIT_S = 0.005


@dataclass
class WaitingRequest:
    """A request whose grammar is compiling: not in the scheduler, holding no KV blocks."""

    request_id: str
    ticket: CompileTicket
    # Queues the request once its grammar is ready (the engine's own add path).
    start: Callable[[], None]


class StructuredOutputManager:
    """Compiles constraints off the step thread and makes each completion's GrammarState.

    `enable_fast_forward`: where the grammar allows exactly one next token, append it without
    sampling (the next step computes it with the others as a prefill chunk).
    `disable_additional_properties`: the engine's default for JSON specs that do not say."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        disable_additional_properties: bool = True,
    ) -> None:
        self.disable_additional_properties = disable_additional_properties
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self.enable_fast_forward = True
        self.waiting: dict[str, WaitingRequest] = {}
        self.num_fast_forward_tokens = 0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self._tokenizer is None:
                raise StructuredOutputError(
                    "structured_outputs needs the model's tokenizer; this engine has none"
                )
            backend = LLGuidanceBackend(
                self._tokenizer,
                self._vocab_size,
                self._eos_token_ids,
                disable_additional_properties=self.disable_additional_properties,
            )
            self._compiler = GrammarCompiler(backend)
        return self._compiler

    def wait_for_grammar(self, request_id: str, spec: StructuredOutputs, start: Callable[[], None]) -> None:
        """Hold a request until its grammar compiles; `start` then queues it."""
        self.waiting[request_id] = WaitingRequest(request_id, self.compiler.submit(spec), start)

    def take_ready(self) -> list[tuple[WaitingRequest, StructuredOutputError | None]]:
        """Requests whose compile has finished (or ran out of time), with the error if it failed."""
        if not self.waiting:
            return []
        compiler = self.compiler
        ready = [w for w in self.waiting.values() if compiler.is_ready(w.ticket)]
        out: list[tuple[WaitingRequest, StructuredOutputError | None]] = []
        for waiting in ready:
            del self.waiting[waiting.request_id]
            try:
                compiler.result(waiting.ticket)
                out.append((waiting, None))
            except StructuredOutputError as exc:
                out.append((waiting, exc))
        return out

    def wait_idle(self) -> None:
        """Called when a step had nothing to run: sleep briefly on the compiles instead of spinning."""
        if self.waiting:
            self.compiler.wait_any([w.ticket for w in self.waiting.values()], IDLE_COMPILE_WAIT_S)

    def new_state(self, spec: StructuredOutputs) -> GrammarState:
        """A fresh matcher at the grammar's start. The grammar is compiled by now (a cache hit);
        if the cache evicted it meanwhile, this compiles it again, on this thread."""
        compiled: CompiledGrammar = self.compiler.compile_now(spec)
        return GrammarState(self.compiler.backend, compiled.new_matcher(), self._vocab_size)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
