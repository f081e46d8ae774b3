"""The batch's output: result lines, and error lines in their own file when `--errors` is given.

Lines are appended as requests finish, one write and one flush each, so that a killed run keeps
every line it wrote. A rerun (resume) reads the custom_ids already there and skips those rows; a
partial last line, cut by the kill, is dropped. An S3 output is written to a local staging file
named after the output URL (so that a rerun finds it) and uploaded when the batch is done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from io import BufferedWriter
from pathlib import Path
from typing import Protocol

from qworker.errors import QworkerError
from qworker.openai.batches.files import Location, download, upload
from qworker.openai.format import BatchOutputLine

logger = logging.getLogger(__name__)


class OutputFileError(QworkerError, ValueError):
    """An existing output that a run cannot resume from."""


def state_path(work_dir: Path, location: Location, suffix: str) -> Path:
    """A file of the batch's own state under `work_dir`, named after an output location."""
    digest = hashlib.sha256(str(location).encode()).hexdigest()[:16]
    name = (location.key if location.key is not None else str(location.path)).rsplit("/", 1)[-1]
    return work_dir / f"{name}.{digest}.{suffix}"


def done_custom_ids(path: Path) -> set[str]:
    """The custom_ids that have a line in the file at `path`. A last line that is cut short or not
    JSON (a write the process did not finish) is cut off the file; a bad line before it is an
    OutputFileError, because dropping it would lose a result."""
    done: set[str] = set()
    if not path.exists():
        return done
    good_end = 0
    bad: tuple[int, str] | None = None
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if bad is not None:
                raise OutputFileError(
                    f"{path}: line {bad[0]} is not an output line ({bad[1]}); fix or remove it, "
                    "or run with --no-resume to start the output over"
                )
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("no newline at its end")
                custom_id = json.loads(raw)["custom_id"]
                if not isinstance(custom_id, str):
                    raise ValueError("custom_id is not a string")
            except (ValueError, KeyError, TypeError) as exc:
                bad = (line_no, str(exc))
                continue
            done.add(custom_id)
            good_end += len(raw)
    if bad is not None:
        logger.warning(
            "%s: dropping an unfinished last line (line %d) left by an interrupted run", path, bad[0]
        )
        os.truncate(path, good_end)
    return done


class OutputFile:
    """One JSONL file of output lines: a local file, or the staging copy of an S3 object."""

    def __init__(self, location: Location, work_dir: Path) -> None:
        self.location = location
        if location.is_s3:
            self.path = state_path(work_dir, location, "staging.jsonl")
        else:
            assert location.path is not None, "a local location has a path"
            self.path = location.path
        self._file: BufferedWriter | None = None
        self.num_lines_written = 0

    def load(self, resume: bool) -> set[str]:
        """Prepare the file and return the custom_ids already in it (none unless `resume`)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume:
            self.path.write_bytes(b"")
            return set()
        if self.location.is_s3 and not self.path.exists():
            # A staging file is a later state than the object (an interrupted rerun); else start
            # from the object a finished run uploaded, if there is one.
            download(self.location, self.path)
        return done_custom_ids(self.path)

    def open(self) -> None:
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, line: BatchOutputLine) -> None:
        assert self._file is not None, "open() the output first"
        self._file.write(line.model_dump_json().encode() + b"\n")
        self._file.flush()
        self.num_lines_written += 1

    def close(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def publish(self) -> None:
        """The batch is done: an S3 output is uploaded and its staging file removed."""
        if self.location.is_s3:
            upload(self.path, self.location)
            self.path.unlink()


class LineSink(Protocol):
    """What BatchOutput writes to: an OutputFile here, or the gateway's parts in its file store
    (gateway/async_api/output_parts.py)."""

    def load(self, resume: bool) -> set[str]: ...

    def open(self) -> None: ...

    def write(self, line: BatchOutputLine) -> None: ...

    def close(self) -> None: ...


class BatchOutput:
    """Where each line goes: error lines to the errors file when there is one, else all to output."""

    def __init__(self, output: LineSink, errors: LineSink | None) -> None:
        self.output = output
        self.errors = errors
        # Called with each line once written: the dashboard's batch board (qworker/pool/batch_board.py).
        self.listeners: list[Callable[[BatchOutputLine], None]] = []

    @property
    def files(self) -> list[LineSink]:
        return [self.output] if self.errors is None else [self.output, self.errors]

    def load(self, resume: bool) -> set[str]:
        done: set[str] = set()
        for file in self.files:
            done |= file.load(resume)
        return done

    def open(self) -> None:
        for file in self.files:
            file.open()

    def write(self, line: BatchOutputLine) -> None:
        (self.errors if self.errors is not None and line.is_error else self.output).write(line)
        for listener in self.listeners:
            listener(line)

    def close(self) -> None:
        for file in self.files:
            file.close()

    def publish(self) -> None:
        for file in self.files:
            assert isinstance(file, OutputFile), "only local and S3 output files are published"
            file.publish()
