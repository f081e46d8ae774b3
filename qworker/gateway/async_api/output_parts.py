"""A batch's output (or error) lines, written to the file store in parts as rows finish.

The driver buffers finished lines in memory and stores them as one part object once the buffer
holds PART_MAX_LINES lines or PART_MAX_BYTES, or `--batch-part-max-age-s` after its first line, whichever
comes first; the part's file id is then appended to a list in the result store. So a replica's
memory holds at most one part per open file, and the lines of every stored part survive a killed
replica: the next driver (any replica: the parts are in the shared file store) reads the parts
the list names to know which custom_ids are done. Lines that were only buffered when a replica
died have their results in the result store, so the next driver collects them again (never
enqueues them again) and writes them to a part of its own.

When the batch ends, the parts are joined, in order, into the one `batch_output` file that
OpenAI's batch object names (`output_file_id`), keeping the first line of each custom_id: a
replica that lost its lease may store one last part after the next driver read the list, and
the joined file still has exactly one line per custom_id. Then the parts are deleted.

A part stored whose id never reached the list (a kill between the two) is not read: its rows are
collected again. It stays in the file store until the store's own expiry removes it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from qworker.gateway.async_api.file_store import FileStore
from qworker.gateway.async_api.records import Records
from qworker.openai.batches.files import split_lines
from qworker.openai.format import BatchOutputLine

logger = logging.getLogger(__name__)

PART_MAX_LINES = 1000
PART_MAX_BYTES = 4 * 2**20


@dataclass
class BatchUsage:
    """Tokens of a batch's output lines, as OpenAI's batch object reports them (`usage`)."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def add_line(self, raw: bytes) -> None:
        try:
            usage = json.loads(raw)["response"]["body"]["usage"]
        except (ValueError, KeyError, TypeError):
            return  # an error line, or a body without usage
        if not isinstance(usage, dict):
            return
        self.input_tokens += int(usage.get("prompt_tokens") or 0)
        self.output_tokens += int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


def _custom_id(raw: bytes) -> str | None:
    try:
        value = json.loads(raw)["custom_id"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


class OutputParts:
    """One output file of a batch (`name`: output or errors) as parts in `files`, their ids in a
    list under `records`. Used as a line sink by batch.output.BatchOutput."""

    def __init__(
        self, files: FileStore, records: Records, batch_id: str, name: str, max_age_s: float
    ) -> None:
        self.files = files
        # A part is stored at most max_age_s after its first line: a slow batch's rows reach the
        # store soon, not only once a thousand have finished.
        self.max_age_s = max_age_s
        self.records = records
        self.batch_id = batch_id
        self.name = name
        self.list_key = records.key("parts", batch_id, name)
        # Part ids name the writer, so two replicas never store under one id.
        self._writer = uuid.uuid4().hex[:8]
        self._buffer: list[bytes] = []
        self._buffered_bytes = 0
        self._first_at = 0.0
        self._num_parts = 0
        self.num_lines_written = 0
        # The tokens of the lines join_into wrote (one per custom_id).
        self.usage = BatchUsage()

    def part_ids(self) -> list[str]:
        return [raw.decode() for raw in self.records.redis.lrange(self.list_key, 0, -1)]

    def load(self, resume: bool) -> set[str]:
        """The custom_ids already stored (parts of earlier drivers). `resume` is always true here:
        the batch's own record says what is done."""
        assert resume, "a batch's output parts always resume"
        done: set[str] = set()
        for part_id in self.part_ids():
            for raw in split_lines(self.files.read(part_id)):
                custom_id = _custom_id(raw)
                if custom_id is not None:
                    done.add(custom_id)
        return done

    def open(self) -> None:
        pass

    def write(self, line: BatchOutputLine) -> None:
        if not self._buffer:
            self._first_at = time.monotonic()
        data = line.model_dump_json().encode() + b"\n"
        self._buffer.append(data)
        self._buffered_bytes += len(data)
        self.num_lines_written += 1
        if len(self._buffer) >= PART_MAX_LINES or self._buffered_bytes >= PART_MAX_BYTES:
            self.flush()

    def flush_if_old(self) -> None:
        if self._buffer and time.monotonic() - self._first_at >= self.max_age_s:
            self.flush()

    def flush(self) -> None:
        """Store the buffered lines as one part, then name it in the list."""
        if not self._buffer:
            return
        part_id = f"part-{self.batch_id}-{self.name}-{self._writer}-{self._num_parts:06d}"
        writer = self.files.writer(part_id)
        try:
            writer.write(b"".join(self._buffer))
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        self.records.redis.rpush(self.list_key, part_id)
        self.records.redis.expire(self.list_key, self.records.ttl_s)
        self._num_parts += 1
        self._buffer = []
        self._buffered_bytes = 0

    def close(self) -> None:
        self.flush()

    def join_into(self, file_id: str) -> int:
        """Write the parts, in order and one line per custom_id, as the file `file_id`; the
        number of bytes written (0: nothing stored, no file)."""
        seen: set[str] = set()
        num_bytes = 0
        writer = self.files.writer(file_id)
        try:
            for part_id in self.part_ids():
                for raw in split_lines(self.files.read(part_id)):
                    custom_id = _custom_id(raw)
                    if custom_id is None or custom_id in seen:
                        continue
                    seen.add(custom_id)
                    self.usage.add_line(raw)
                    line = raw if raw.endswith(b"\n") else raw + b"\n"
                    writer.write(line)
                    num_bytes += len(line)
            if num_bytes == 0:
                writer.abort()
                return 0
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        return num_bytes

    def delete_parts(self) -> None:
        for part_id in self.part_ids():
            try:
                self.files.delete(part_id)
            except Exception:  # the store's expiry removes it in the end
                logger.warning("batch %s: could not delete output part %s", self.batch_id, part_id)
        self.records.redis.delete(self.list_key)
