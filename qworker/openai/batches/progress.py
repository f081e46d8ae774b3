"""Progress of a batch run: a bar on a terminal (rows done and failed, output tok/s, ETA), a plain
log line every few seconds elsewhere, and a summary at the end."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TextIO

logger = logging.getLogger("qworker.batch")


class ProgressMode(str, Enum):
    AUTO = "auto"  # a bar on a terminal, else log lines
    BAR = "bar"
    LOG = "log"
    NONE = "none"


@dataclass
class BatchSummary:
    """Counts of one run of a batch (a rerun counts only what it did itself)."""

    num_input_rows: int
    # Rows that had a line in the output before this run: skipped.
    num_already_done: int
    num_run: int = 0
    num_failed: int = 0
    status_codes: Counter[int] = field(default_factory=Counter)
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    # Pool mode: jobs this run put on the queue (a rerun enqueues only rows no run enqueued).
    num_enqueued: int | None = None
    # Pool mode: rows whose results were stored before this run: collected, not generated, so
    # their tokens are not in the token counts or the throughput.
    num_collected: int = 0
    wall_s: float = 0.0

    @property
    def num_to_run(self) -> int:
        return self.num_input_rows - self.num_already_done

    @property
    def output_throughput(self) -> float:
        return self.num_completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_text(self) -> str:
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(self.status_codes.items()) if code >= 400)
        parts = [
            f"{self.num_input_rows} rows",
            f"{self.num_already_done} already in the output",
            f"{self.num_run} run: {self.num_run - self.num_failed} ok, {self.num_failed} failed"
            + (f" ({codes})" if codes else ""),
        ]
        if self.num_enqueued is not None:
            parts.append(f"{self.num_enqueued} enqueued, {self.num_collected} collected from earlier runs")
        rate = self.num_run / self.wall_s if self.wall_s > 0 else 0.0
        parts.append(
            f"{self.num_prompt_tokens} prompt + {self.num_completion_tokens} completion tokens generated in "
            f"{self.wall_s:.1f} s: {self.output_throughput:.1f} output tok/s, {rate:.2f} rows/s"
        )
        return "qworker batch: " + "; ".join(parts)


class Progress:
    """Counts finished rows into `summary` and shows them as `mode` says."""

    def __init__(
        self,
        summary: BatchSummary,
        mode: ProgressMode = ProgressMode.AUTO,
        interval_s: float = 10.0,
        stream: TextIO | None = None,
    ) -> None:
        self.summary = summary
        self.interval_s = interval_s
        self.stream = stream if stream is not None else sys.stderr
        if mode is ProgressMode.AUTO:
            mode = ProgressMode.BAR if self.stream.isatty() else ProgressMode.LOG
        self.mode = mode
        self._started = time.monotonic()
        self._last_log = self._started
        self._bar: Any = None

    def start(self) -> None:
        """The run begins (the model is loaded, the queue open): the clock starts, the bar shows."""
        self._started = self._last_log = time.monotonic()
        if self.mode is ProgressMode.BAR and self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.summary.num_to_run, unit="row", desc="batch", file=self.stream, dynamic_ncols=True
            )

    def row_done(
        self,
        status_code: int,
        num_prompt_tokens: int = 0,
        num_completion_tokens: int = 0,
        *,
        collected: bool = False,
    ) -> None:
        """A row has its line. `collected`: its result was stored before this run (tokens not counted)."""
        s = self.summary
        s.num_run += 1
        s.num_collected += collected
        s.status_codes[status_code] += 1
        if status_code >= 400:
            s.num_failed += 1
        s.num_prompt_tokens += num_prompt_tokens
        s.num_completion_tokens += num_completion_tokens
        if self._bar is not None:
            elapsed = max(1e-9, time.monotonic() - self._started)
            self._bar.set_postfix_str(
                f"failed={s.num_failed}, {s.num_completion_tokens / elapsed:.0f} out tok/s", refresh=False
            )
            self._bar.update(1)
        self.tick()

    def tick(self) -> None:
        """A log line when one is due (log mode); cheap enough to call every engine step."""
        if self.mode is not ProgressMode.LOG:
            return
        now = time.monotonic()
        if now - self._last_log < self.interval_s:
            return
        self._last_log = now
        s = self.summary
        elapsed = now - self._started
        eta = ""
        if s.num_run:
            eta = f", ETA {(s.num_to_run - s.num_run) * elapsed / s.num_run:.0f} s"
        logger.info(
            "batch progress: %d/%d rows (%d failed, %d collected from earlier runs), %.1f output tok/s%s",
            s.num_run,
            s.num_to_run,
            s.num_failed,
            s.num_collected,
            s.num_completion_tokens / elapsed if elapsed > 0 else 0.0,
            eta,
        )

    def close(self) -> BatchSummary:
        self.summary.wall_s = time.monotonic() - self._started
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        return self.summary
