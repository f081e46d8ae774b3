"""Grammar compilation off the step thread, with a cache keyed by the constraint's canonical text.

A request with a constraint waits here, holding no KV blocks, until its grammar is ready; the
engine polls `poll()` once per step. A thousand jobs with one schema compile it once: the
first submits the work, the others share its future. A compile that fails or runs past
`timeout_s` fails its own requests and nothing else.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from qworker.engine.structured.backend import CompiledGrammar, GrammarBackend
from qworker.engine.structured.spec import StructuredOutputError, StructuredOutputs

# Measured on SmolLM2 (2-core EPYC): SchemaStore schemas compile in 1-300 ms; llguidance's own
# limits stop a pathological grammar well before this.
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_SIZE = 1024


@dataclass
class CompileTicket:
    """One request's wait for its grammar."""

    spec: StructuredOutputs
    future: Future[CompiledGrammar]
    submitted_at: float


class GrammarCompiler:
    """Compiles on `num_threads` helper threads (the backend drops the GIL while it works)."""

    def __init__(
        self,
        backend: GrammarBackend,
        *,
        num_threads: int = 1,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self._cache_size = cache_size
        # cache key -> its compile (done or running); least recently used first.
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._num_threads = num_threads
        self.num_compiles = 0
        self.num_cache_hits = 0

    def submit(self, spec: StructuredOutputs) -> CompileTicket:
        key = spec.cache_key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="qworker-grammar")
            future = self._pool.submit(self.backend.compile, spec)
            self.num_compiles += 1
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return CompileTicket(spec, future, time.monotonic())

    def compile_now(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar, waiting for it (a cache hit returns at once)."""
        return self.result(self.submit(spec), block=True)

    def result(self, ticket: CompileTicket, *, block: bool = False) -> CompiledGrammar:
        """The grammar of a finished ticket, or StructuredOutputError (compile failure or timeout).
        Without `block`, call only once `is_ready(ticket)`."""
        try:
            return ticket.future.result(timeout=self._time_left(ticket) if block else 0)
        except TimeoutError:
            raise StructuredOutputError(
                f"structured_outputs.{ticket.spec.kind} did not compile within {self.timeout_s:g} s"
            ) from None
        except StructuredOutputError:
            raise
        except Exception as exc:  # the backend's own failure, named for the user
            raise StructuredOutputError(
                f"structured_outputs.{ticket.spec.kind} could not be compiled: {type(exc).__name__}: {exc}"
            ) from None

    def is_ready(self, ticket: CompileTicket) -> bool:
        """Done compiling, or out of time (result() then raises)."""
        return ticket.future.done() or self._time_left(ticket) <= 0

    def wait_any(self, tickets: list[CompileTicket], timeout_s: float) -> None:
        """Sleep until one of `tickets` finishes or `timeout_s` passes: an engine with nothing
        but compiles to wait for does not spin."""
        if tickets:
            wait_futures([t.future for t in tickets], timeout=timeout_s, return_when="FIRST_COMPLETED")

    def _time_left(self, ticket: CompileTicket) -> float:
        return max(0.0, ticket.submitted_at + self.timeout_s - time.monotonic())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
