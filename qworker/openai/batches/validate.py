"""The whole-file check that runs before any work, as OpenAI and vLLM do: every line is JSON, an
object, with a unique non-empty string `custom_id` and `method` POST. One bad line fails the whole
batch (exit code 2), naming the line numbers; nothing is written and nothing is enqueued.

Problems of a single row's request (its url, its body) are not checked here: they give that row
an error line, and the other rows still run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from qworker.errors import QworkerError
from qworker.openai.batches.files import Location, read_lines

# Problems listed in the error message; the count covers them all.
MAX_PROBLEMS_SHOWN = 20


class BatchFileError(QworkerError, ValueError):
    """The input is not a batch file: `problems` are "line N: ..." texts."""

    def __init__(self, location: Location, problems: list[str]) -> None:
        self.location = location
        self.problems = problems
        shown = "\n".join(f"  {p}" for p in problems[:MAX_PROBLEMS_SHOWN])
        more = len(problems) - MAX_PROBLEMS_SHOWN
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(
            f"{location} is not a valid batch file ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}); nothing was run:\n{shown}{tail}"
        )


@dataclass
class CheckedInput:
    """What the check learned on its pass over the file."""

    num_rows: int
    # sha256 of the file's lines: the default batch id, so that the same file is the same batch.
    content_hash: str
    custom_ids: set[str]


def _line_problem(data: object, line_no: int, first_line_of: dict[str, int]) -> str | None:
    if not isinstance(data, dict):
        return f"line {line_no}: a request must be a JSON object, got {type(data).__name__}"
    custom_id = data.get("custom_id")
    if "custom_id" not in data:
        return f"line {line_no}: no custom_id"
    if not isinstance(custom_id, str) or not custom_id:
        return f"line {line_no}: custom_id must be a non-empty string, got {custom_id!r}"
    if custom_id in first_line_of:
        return f"line {line_no}: custom_id {custom_id!r} repeats line {first_line_of[custom_id]}"
    first_line_of[custom_id] = line_no
    method = data.get("method")
    if method != "POST":
        return f"line {line_no}: method must be POST, got {method!r}"
    return None


def check_input(location: Location) -> CheckedInput:
    """Read the whole input once; raise BatchFileError listing every bad line."""
    problems: list[str] = []
    first_line_of: dict[str, int] = {}
    digest = hashlib.sha256()
    num_rows = 0
    for line_no, raw in enumerate(read_lines(location), 1):
        digest.update(raw + b"\n")
        if not raw.strip():
            continue
        num_rows += 1
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(f"line {line_no}: not JSON ({exc})")
            continue
        problem = _line_problem(data, line_no, first_line_of)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise BatchFileError(location, problems)
    return CheckedInput(num_rows, digest.hexdigest(), set(first_line_of))
