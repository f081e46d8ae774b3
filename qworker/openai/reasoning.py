"""Reasoning read from a model's text: the `<think>...</think>` block that reasoning models write
before their answer, returned apart from the content (OpenAI-compatible servers' `reasoning_content`).

Formats, and where they come from (as the model families document them and as vLLM's reasoning
parsers of the same names read them):

- `qwen3`: Qwen3's thinking mode (its model card and chat template): the reply starts with
  `<think>`, the reasoning runs to `</think>`, the answer follows. A reply without `<think>` has
  no reasoning (Qwen3 with `enable_thinking: false`: the template writes an empty block into the
  prompt, so the reply is all answer). A reply cut before `</think>` is all reasoning.
- `deepseek_r1`: DeepSeek-R1's format (its model card; its template, like Qwen3's 2507 thinking
  models', writes `<think>` into the prompt, so the reply may start without it): everything up to
  `</think>` is reasoning, an opening `<think>` is dropped; a reply without `</think>` is all
  reasoning, as vLLM's parser reads it.

The split is a function of the text so far (`is_final` false: what can be said already), made so
that reasoning and content only grow as text arrives (a partial tag at the end is held back), so
that streamed deltas join into the unstreamed answer. Whitespace around the reasoning and at the
start of the content is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN3 = "qwen3"
DEEPSEEK_R1 = "deepseek_r1"
# What --reasoning-parser takes (vLLM's names).
REASONING_PARSERS = (QWEN3, DEEPSEEK_R1)

THINK_START, THINK_END = "<think>", "</think>"
WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ReasoningSplit:
    # None: no reasoning block (qwen3 without <think>).
    reasoning: str | None
    # None: the reply ended inside its reasoning.
    content: str | None


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _after_start(text: str, *, is_final: bool) -> tuple[int | None, bool]:
    """(where the reasoning starts after an opening <think>, or None without one; whether the
    text could still become one, i.e. it is a proper prefix of <think>)."""
    lead = len(text) - len(text.lstrip(WHITESPACE))
    rest = text[lead:]
    if rest.startswith(THINK_START):
        return lead + len(THINK_START), False
    return None, (not is_final and THINK_START.startswith(rest))


def _split_at_end(text: str, start: int, *, is_final: bool) -> ReasoningSplit:
    close = text.find(THINK_END, start)
    if close < 0:
        body = text[start:] if is_final else text[start : len(text) - _held(text[start:], THINK_END)]
        return ReasoningSplit(body.strip(WHITESPACE), None)
    content = text[close + len(THINK_END) :].lstrip(WHITESPACE)
    return ReasoningSplit(text[start:close].strip(WHITESPACE), content)


def split_reasoning(parser: str, text: str, *, is_final: bool) -> ReasoningSplit:
    start, is_undecided = _after_start(text, is_final=is_final)
    if is_undecided:
        return ReasoningSplit(None, None)
    if parser == QWEN3:
        if start is None:
            return ReasoningSplit(None, text)
        return _split_at_end(text, start, is_final=is_final)
    if parser == DEEPSEEK_R1:
        return _split_at_end(text, start or 0, is_final=is_final)
    raise ValueError(f"unknown reasoning parser {parser!r}; use one of {', '.join(REASONING_PARSERS)}")


def check_reasoning_parser(name: str | None) -> str | None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; use one of {', '.join(REASONING_PARSERS)}")
    return name


class ReasoningStream:
    """The reasoning deltas of one completion's text as it streams, and the content after the
    reasoning (for the tool parser, or as content deltas)."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = ""
        self.sent_content = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(new reasoning, new content)."""
        self.text += text
        return self._diff(split_reasoning(self.parser, self.text, is_final=False))

    def finish(self) -> tuple[str, str]:
        return self._diff(split_reasoning(self.parser, self.text, is_final=True))

    def _diff(self, split: ReasoningSplit) -> tuple[str, str]:
        reasoning, content = split.reasoning or "", split.content or ""
        new_reasoning = new_content = ""
        if reasoning.startswith(self.sent_reasoning):
            new_reasoning = reasoning[len(self.sent_reasoning) :]
            self.sent_reasoning = reasoning
        if content.startswith(self.sent_content):
            new_content = content[len(self.sent_content) :]
            self.sent_content = content
        return new_reasoning, new_content


def reasoning_delta(text: str) -> dict[str, Any]:
    """A delta of reasoning, under both names OpenAI-compatible servers use (vLLM's
    `reasoning_content`, and `reasoning`, its newer name): a client reads one of them."""
    return {"reasoning_content": text, "reasoning": text}
