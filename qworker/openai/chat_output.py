"""A chat completion's text as OpenAI's message: the reasoning split off first (reasoning.py),
then tool calls read from the content after it (tool_parsers.py), as vLLM orders them. One code
path for the stored answer (`parse_message`) and the stream (`MessageStream`), so that the
stream's deltas join into the stored answer's message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qworker.openai.reasoning import ReasoningStream, reasoning_delta, split_reasoning
from qworker.openai.tool_parsers import Delta, ToolCalling, ToolCallStream, openai_tool_calls


@dataclass(frozen=True)
class OutputParsing:
    """What a row's output is read for; None fields: not read for it."""

    tool_calling: ToolCalling | None = None
    reasoning_parser: str | None = None

    @property
    def is_active(self) -> bool:
        return self.tool_calling is not None or self.reasoning_parser is not None


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


def parse_message(parsing: OutputParsing, text: str, seed: str) -> ParsedMessage:
    """The message of a finished completion; `seed` makes the calls' ids (the stream's too)."""
    reasoning = None
    content: str | None = text
    if parsing.reasoning_parser is not None:
        split = split_reasoning(parsing.reasoning_parser, text, is_final=True)
        reasoning, content = split.reasoning, split.content
    if parsing.tool_calling is None or content is None:
        return ParsedMessage(content, reasoning)
    parsed = parsing.tool_calling.make_parser().parse(content, is_final=True)
    calls = openai_tool_calls(parsed.calls, seed) if parsed.calls else None
    return ParsedMessage(parsed.content, reasoning, calls)


class MessageStream:
    """The deltas of one completion as its text streams in (`feed`), and the rest once it ends
    (`finish`)."""

    def __init__(self, parsing: OutputParsing, seed: str) -> None:
        self.reasoning = ReasoningStream(parsing.reasoning_parser) if parsing.reasoning_parser else None
        self.tools = (
            ToolCallStream(parsing.tool_calling.make_parser(), seed) if parsing.tool_calling else None
        )

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(*(self.reasoning.feed(text) if self.reasoning else ("", text)), is_final=False)

    def finish(self) -> list[Delta]:
        return self._deltas(*(self.reasoning.finish() if self.reasoning else ("", "")), is_final=True)

    def _deltas(self, reasoning: str, content: str, *, is_final: bool) -> list[Delta]:
        out: list[Delta] = [reasoning_delta(reasoning)] if reasoning else []
        if self.tools is None:
            if content:
                out.append({"content": content})
            return out
        out.extend(self.tools.feed(content))
        if is_final:
            out.extend(self.tools.finish())
        return out
