"""The worker's writes to the broker, in the order the job lifecycle needs them: a step's text
deltas, then each ended job's result, then its acks (or dead letters).

Writes wait here whenever the broker is away. A flush stops at the first error and keeps its
progress (an ack already made is not repeated), so the loop retries it on the outage's backoff
while the engine keeps stepping. A result whose acks failed is checked again before them: the
error may have been a failover to a replica that never received it (Redis replicates
asynchronously), and acking there without the result would lose the job. Results and acks
are never dropped; deltas are bounded: past `max_buffered_deltas`, new ones are dropped (the live
stream then misses tokens; the result, written after them, still holds the whole text).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from qworker.backends.sink import Delta, ResultSink
from qworker.backends.source import JobSource, Lease
from qworker.jobs.job import JobResult

logger = logging.getLogger(__name__)

MAX_BUFFERED_DELTAS = 50_000


@dataclass
class PendingFinal:
    """How a job ends, waiting to reach the broker: its result (if any) is stored first, then
    each lease is acked, or dead-lettered when `dead_letter` gives (kind, reason)."""

    result: JobResult | None
    leases: list[Lease]
    dead_letter: tuple[str, str] | None = None
    is_stored: bool = False
    # on_stored has run: a result written again after a failover is not counted twice.
    is_reported: bool = False


@dataclass
class Outbox:
    max_buffered_deltas: int = MAX_BUFFERED_DELTAS
    num_deltas_dropped: int = 0
    _deltas: list[Delta] = field(default_factory=list)
    _finals: list[PendingFinal] = field(default_factory=list)
    # Job id -> its final waiting here, so that a redelivery of that job joins it.
    _final_by_job: dict[str, PendingFinal] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self._deltas or self._finals)

    @property
    def has_finals(self) -> bool:
        return bool(self._finals)

    @property
    def num_unstored_results(self) -> int:
        return sum(1 for f in self._finals if f.result is not None and not f.is_stored)

    def final_for(self, job_id: str) -> PendingFinal | None:
        return self._final_by_job.get(job_id)

    def add_deltas(self, deltas: list[Delta]) -> None:
        room = self.max_buffered_deltas - len(self._deltas)
        if len(deltas) > room:
            if self.num_deltas_dropped == 0 or room > 0:
                logger.warning(
                    "%d deltas wait for the broker; dropping new ones until it returns", len(self._deltas)
                )
            self.num_deltas_dropped += len(deltas) - max(0, room)
            deltas = deltas[: max(0, room)]
        self._deltas.extend(deltas)

    def add_final(self, final: PendingFinal) -> None:
        self._finals.append(final)
        if final.result is not None:
            self._final_by_job[final.result.id] = final

    def flush(
        self, sink: ResultSink, source: JobSource, on_stored: Callable[[JobResult, bool], None]
    ) -> None:
        """Write what waits to `sink` and `source`, in order; raises the first broker error,
        keeping the progress made.
        `on_stored(result, is_new)` is called once per result written (is_new False: the store
        already held a result for that id, which is kept)."""
        if self._deltas:
            sink.write_deltas(self._deltas)
            self._deltas = []
        while self._finals:
            final = self._finals[0]
            try:
                self._store(final, sink, on_stored)
                while final.leases:
                    if final.dead_letter is not None:
                        source.dead_letter(final.leases[0], final.dead_letter[1])
                    else:
                        source.ack(final.leases[0])
                    final.leases.pop(0)
            except Exception:
                # Stored where the broker was; whether it is where the broker is now, the retry
                # asks before it acks.
                final.is_stored = False
                raise
            self._finals.pop(0)
            if final.result is not None and self._final_by_job.get(final.result.id) is final:
                del self._final_by_job[final.result.id]

    @staticmethod
    def _store(final: PendingFinal, sink: ResultSink, on_stored: Callable[[JobResult, bool], None]) -> None:
        if final.result is None or final.is_stored:
            return
        if final.is_reported:
            # A retry after an error: written again only where the store lost it.
            if not sink.has_result(final.result.id):
                sink.write_result(final.result)
                logger.warning(
                    "job %s: its stored result was gone after a broker error; written again", final.result.id
                )
            final.is_stored = True
            return
        is_new = sink.write_result(final.result)
        final.is_stored = final.is_reported = True
        on_stored(final.result, is_new)
