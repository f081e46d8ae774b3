"""Tool calls read from a model's text, whole (a stored result) or as it streams.

Formats, and where they come from (each as its model family documents it and as vLLM's tool
parser of the same name reads it):

- `hermes`: NousResearch's Hermes 2 Pro function-calling format, which Qwen 2.5 and Qwen 3 use
  in their chat templates: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, with text around them allowed.
- `llama3_json`: Meta's Llama 3.1/3.2 JSON tool calling (the model card's "JSON based tool
  calling" prompt format): the reply starts with `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several calls separated by `;`. A reply that does not start with a call
  is text; text after the calls is content.
- `mistral`: Mistral's v3 tokenizer format (mistral-common): text, then `[TOOL_CALLS]` and a JSON
  list `[{"name": ..., "arguments": {...}}, ...]`. `[TOOL_CALLS]` is a special token, so it is in
  the text only when the job keeps special tokens (`skip_special_tokens: false`; the gateway sets
  it for this parser).

Forced calls (`tool_choice` "required" or a named function) are decoded under a grammar and read
by `forced_arguments` (the whole text is the one function's arguments) or `forced_wrapped` (the
text is one `{"name", "arguments"}` object), as vLLM's guided tool choice writes them.

Either key `arguments` or `parameters` names a call's arguments (as vLLM's parsers accept both);
they must be a JSON object. A call's `arguments` string is exactly the text of that object in the
model's output (never re-serialized), so that the fragments a stream sends join into the string
the unstreamed answer holds.

What is malformed (a block whose JSON does not parse, an unknown function, arguments that are not
an object) stays text: it is returned as content, never an error.

The parse is a function of the text so far (`is_final` false: what can be said already), made so
that each answer extends the previous one: content only grows, calls are only added, a call's
arguments only grow. A stream sends the difference (`ToolCallStream`), so its deltas join into
the unstreamed answer, malformed output included. For that, a call the model writes freely (the
`hermes`, `llama3_json`, `mistral` parsers) is sent once it is decided, that is once its block
has closed (hermes) or its JSON object has (the others): its name first, then its arguments in
one fragment. A forced call is decoded under a grammar, so its JSON cannot break: it is sent as
it is generated, the name first, then fragments of the arguments. The one case where a stream and
the stored answer differ is a forced call cut by max_tokens: the stream has sent the call's start
(finish_reason "length"), the stored answer gives the text as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
FORCED_ARGUMENTS = "forced_arguments"
FORCED_WRAPPED = "forced_wrapped"
# What --tool-call-parser takes (vLLM's names).
AUTO_PARSERS = (HERMES, LLAMA3_JSON, MISTRAL)

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOKEN = "[TOOL_CALLS]"
ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\n\r"
_SCALAR_END = re.compile(r"[,}\]\s]")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    # The arguments object's text as the model wrote it ("" while it has not started).
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    # None: no text besides the calls.
    content: str | None
    calls: tuple[ParsedCall, ...] = ()


def call_id(seed: str, index: int) -> str:
    """The id of call `index` of one completion: the same in a stream and in the stored answer."""
    return "call_" + uuid.uuid5(uuid.NAMESPACE_OID, seed if index == 0 else f"{seed}/{index}").hex[:24]


# -- a JSON object's top-level structure, read from a prefix ------------------------------------


@dataclass
class ObjectScan:
    """The top level of a JSON object that starts at `start`: its keys and where their values lie.
    `end` is None while the object is not closed in the text; `is_broken` once it cannot be JSON."""

    start: int
    end: int | None = None
    # key -> (value start, value end or None while the value runs to the end of the text)
    values: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    is_broken: bool = False

    def string_value(self, text: str, key: str) -> str | None:
        """The key's value when it is a complete JSON string."""
        span = self.values.get(key)
        if span is None or span[1] is None or text[span[0]] != '"':
            return None
        try:
            value = json.loads(text[span[0] : span[1]])
        except ValueError:
            return None
        return value if isinstance(value, str) else None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _skip_string(text: str, i: int) -> int | None:
    """The index after the string that opens at text[i] ('"'); None if it does not close."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        else:
            i += 1
    return None


def _skip_nested(text: str, i: int) -> int | None:
    """The index after the object or list that opens at text[i]; None if it does not close."""
    depth = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            after = _skip_string(text, i)
            if after is None:
                return None
            i = after
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _skip_value(text: str, i: int) -> int | None:
    c = text[i]
    if c == '"':
        return _skip_string(text, i)
    if c in "{[":
        return _skip_nested(text, i)
    match = _SCALAR_END.search(text, i)
    return match.start() if match else None


def scan_object(text: str, start: int) -> ObjectScan:
    """Read the object at text[start] ('{') as far as the text goes."""
    scan = ObjectScan(start)
    i = _skip_ws(text, start + 1)
    expect_key = True
    while i < len(text):
        c = text[i]
        if c == "}":
            scan.end = i + 1
            return scan
        if expect_key:
            if c == ",":
                i = _skip_ws(text, i + 1)
                continue
            if c != '"':
                scan.is_broken = True
                return scan
            key_end = _skip_string(text, i)
            if key_end is None:
                return scan
            try:
                key = json.loads(text[i:key_end])
            except ValueError:
                scan.is_broken = True
                return scan
            i = _skip_ws(text, key_end)
            if i >= len(text):
                return scan
            if text[i] != ":":
                scan.is_broken = True
                return scan
            i = _skip_ws(text, i + 1)
            if i >= len(text):
                return scan
            value_end = _skip_value(text, i)
            scan.values[key] = (i, value_end)
            if value_end is None:
                return scan
            i = _skip_ws(text, value_end)
            if i < len(text) and text[i] not in ",}":
                scan.is_broken = True
                return scan
            expect_key = False
        else:  # after a value: "," then a key, or the closing brace above
            if c != ",":
                scan.is_broken = True
                return scan
            i = _skip_ws(text, i + 1)
            expect_key = True
    return scan


def _arguments_key(scan: ObjectScan) -> str | None:
    return next((k for k in ARGUMENT_KEYS if k in scan.values), None)


@dataclass(frozen=True)
class _Call:
    """One call object, read: a complete call, a call under way, undecided, or not a call."""

    call: ParsedCall | None
    is_decided: bool  # False: nothing can be said yet
    is_call: bool


def read_call(text: str, start: int, end: int, names: frozenset[str], *, is_complete: bool) -> _Call:
    """The `{"name", "arguments"}` object at text[start:end]. `is_complete`: nothing more of it
    will come (its closing tag is in the text, or the output ended)."""
    scan = scan_object(text, start)
    if scan.end is not None and scan.end > end:
        scan = ObjectScan(start, is_broken=True)
    if is_complete or scan.end is not None:
        if scan.end is None or scan.is_broken:
            return _Call(None, is_complete, False)
        if text[scan.end : end].strip(WHITESPACE):
            return _Call(None, is_complete, False)  # something after the object: decided when complete
        try:
            value = json.loads(text[start : scan.end])
        except ValueError:
            return _Call(None, True, False)
        name = value.get("name") if isinstance(value, dict) else None
        key = _arguments_key(scan)
        if not isinstance(name, str) or name not in names:
            return _Call(None, True, False)
        if key is None:
            return _Call(ParsedCall(name, "{}"), True, True)
        vs, ve = scan.values[key]
        if not isinstance(value.get(key), dict):
            return _Call(None, True, False)
        return _Call(ParsedCall(name, text[vs:ve]), True, True)
    # Under way: a call can be shown once its name is known and its arguments object has begun.
    if scan.is_broken:
        return _Call(None, True, False)
    name = scan.string_value(text, "name")
    if "name" in scan.values and scan.values["name"][1] is not None and name is None:
        return _Call(None, True, False)  # a name that is not a string
    if name is not None and name not in names:
        return _Call(None, True, False)
    key = _arguments_key(scan)
    if name is None or key is None:
        return _Call(None, False, False)
    vs, ve = scan.values[key]
    if text[vs] != "{":
        return _Call(None, True, False)
    return _Call(ParsedCall(name, text[vs : ve if ve is not None else end]), False, True)


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _finish(parts: list[str], calls: list[ParsedCall], parallel: bool, is_final: bool) -> ParsedOutput:
    content = "".join(parts).strip(WHITESPACE)
    if not parallel:
        calls = calls[:1]
    return ParsedOutput(None if (calls and not content) else content, tuple(calls))


# -- the parsers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HermesParser:
    names: frozenset[str]
    parallel: bool = True

    def parse(self, text: str, *, is_final: bool) -> ParsedOutput:
        parts: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            i = text.find(HERMES_START, pos)
            if i < 0:
                tail = text[pos:]
                if not is_final:
                    tail = tail[: len(tail) - _held_prefix(tail, HERMES_START)]
                parts.append(tail)
                break
            parts.append(text[pos:i])
            body = _skip_ws(text, i + len(HERMES_START))
            close = text.find(HERMES_END, body)
            end = close if close >= 0 else len(text)
            block_end = close + len(HERMES_END) if close >= 0 else len(text)
            is_complete = close >= 0 or is_final
            if body >= end:
                if is_complete:
                    parts.append(text[i:block_end])
                    pos = block_end
                    continue
                break  # "<tool_call>" and nothing yet
            if text[body] != "{":
                parts.append(text[i:block_end])
                if close < 0:
                    break
                pos = block_end
                continue
            read = read_call(text, body, end, self.names, is_complete=is_complete)
            if not is_complete:
                # A call is shown once its block has closed: until then its JSON may still break.
                if read.is_decided and not read.is_call:
                    parts.append(text[i:block_end])
                break
            if read.is_call and read.call is not None:
                calls.append(read.call)
            else:
                parts.append(text[i:block_end])
            pos = block_end
        return _finish(parts, calls, self.parallel, is_final)


@dataclass(frozen=True)
class _JsonListParser:
    """Calls as JSON objects after an optional marker, separated by `separator`; llama3_json
    (the whole reply, `;`) and mistral (after `[TOOL_CALLS]`, a list) differ in those parts."""

    names: frozenset[str]
    parallel: bool = True

    marker = ""
    separator = ";"
    opening = ""
    closing = ""
    text_before_marker = False

    def parse(self, text: str, *, is_final: bool) -> ParsedOutput:
        if self.text_before_marker:
            at = text.find(self.marker)
            if at < 0:
                before = text if is_final else text[: len(text) - _held_prefix(text, self.marker)]
                return _finish([before], [], self.parallel, is_final)
            before, i = text[:at], at + len(self.marker)
        else:
            before, i = "", _skip_ws(text, 0)
            if text.startswith(self.marker, i):
                i += len(self.marker)
            elif not is_final and self.marker.startswith(text[i:]):
                return ParsedOutput("", ())  # could still be the marker
        everything = _finish([text], [], self.parallel, is_final)
        i = _skip_ws(text, i)
        if self.opening:
            if i >= len(text):
                return everything if is_final else _finish([before], [], self.parallel, is_final)
            if text[i] != self.opening:
                return everything
            i = _skip_ws(text, i + 1)
        calls: list[ParsedCall] = []
        while True:
            if i >= len(text):
                if is_final and not calls:
                    return everything
                return _finish([before], calls, self.parallel, is_final)  # more may come
            if text[i] != "{":
                break
            scan = scan_object(text, i)
            if scan.end is None:
                if is_final or scan.is_broken:
                    break
                read = read_call(text, i, len(text), self.names, is_complete=False)
                if read.is_decided and not read.is_call:
                    break
                return _finish([before], calls, self.parallel, is_final)  # under way: held
            read = read_call(text, i, scan.end, self.names, is_complete=True)
            if not read.is_call or read.call is None:
                break
            calls.append(read.call)
            i = _skip_ws(text, scan.end)
            if i < len(text) and text[i] == self.separator:
                i = _skip_ws(text, i + 1)
            elif self.closing and i < len(text) and text[i] == self.closing:
                i += 1
                break
            elif i < len(text):
                break
        # Text after the calls is content; a reply whose first object is no call is all content.
        if not calls:
            return everything
        return _finish([before, text[i:]], calls, self.parallel, is_final)


@dataclass(frozen=True)
class Llama3JsonParser(_JsonListParser):
    marker = PYTHON_TAG
    separator = ";"


@dataclass(frozen=True)
class MistralParser(_JsonListParser):
    marker = MISTRAL_TOKEN
    separator = ","
    opening = "["
    closing = "]"
    text_before_marker = True


@dataclass(frozen=True)
class ForcedArgumentsParser:
    """A forced call of one function: the whole text is its arguments object."""

    name: str

    def parse(self, text: str, *, is_final: bool) -> ParsedOutput:
        arguments = text.strip(WHITESPACE)
        if is_final:
            try:
                is_object = isinstance(json.loads(arguments), dict)
            except ValueError:
                is_object = False
            if not is_object:
                return ParsedOutput(text, ())
        elif not arguments.startswith("{"):
            return ParsedOutput("", ())
        return ParsedOutput(None, (ParsedCall(self.name, arguments),))


@dataclass(frozen=True)
class ForcedWrappedParser:
    """A forced call of one of several functions: the text is one `{"name", "arguments"}`."""

    names: frozenset[str]

    def parse(self, text: str, *, is_final: bool) -> ParsedOutput:
        start = _skip_ws(text, 0)
        if start >= len(text) or text[start] != "{":
            return ParsedOutput(text if is_final else "", ())
        read = read_call(text, start, len(text), self.names, is_complete=is_final)
        if read.is_call and read.call is not None:
            return ParsedOutput(None, (read.call,))
        return ParsedOutput(text if is_final else "", ())


ToolParser = HermesParser | Llama3JsonParser | MistralParser | ForcedArgumentsParser | ForcedWrappedParser


@dataclass(frozen=True)
class ToolCalling:
    """How a row's output is read for calls: the parser's name, the functions it may call, and
    OpenAI's parallel_tool_calls (False: the first call only)."""

    parser: str
    names: tuple[str, ...]
    parallel: bool = True

    @property
    def is_forced(self) -> bool:
        return self.parser in (FORCED_ARGUMENTS, FORCED_WRAPPED)

    def make_parser(self) -> ToolParser:
        names = frozenset(self.names)
        if self.parser == HERMES:
            return HermesParser(names, self.parallel)
        if self.parser == LLAMA3_JSON:
            return Llama3JsonParser(names, self.parallel)
        if self.parser == MISTRAL:
            return MistralParser(names, self.parallel)
        if self.parser == FORCED_ARGUMENTS:
            return ForcedArgumentsParser(self.names[0])
        if self.parser == FORCED_WRAPPED:
            return ForcedWrappedParser(names)
        raise ValueError(f"unknown tool call parser {self.parser!r}; use one of {', '.join(AUTO_PARSERS)}")


def openai_tool_calls(calls: tuple[ParsedCall, ...], seed: str) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls."""
    return [
        {"id": call_id(seed, i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(calls)
    ]


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template implies: the format it asks the model to write calls in.
    A template that does not render `tools` (or none known yet) gets `hermes`, the format of the
    system message written for such templates (qworker/engine/structured/tool_calls.py); None
    when the template renders tools in a way none of the parsers reads, or in several."""
    if not chat_template or "tools" not in chat_template:
        return HERMES
    found = []
    if HERMES_START in chat_template:
        found.append(HERMES)
    if PYTHON_TAG in chat_template or "ipython" in chat_template:
        found.append(LLAMA3_JSON)
    if MISTRAL_TOKEN in chat_template:
        found.append(MISTRAL)
    return found[0] if len(found) == 1 else None


# -- streaming ------------------------------------------------------------------------------------

Delta = dict[str, Any]


class ToolCallStream:
    """OpenAI's chat deltas for one completion's text, fed as it streams: `{"content": ...}` and
    `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}` for a new
    call, then `{"tool_calls": [{"index", "function": {"arguments": fragment}}]}`. The deltas of
    `feed` and `finish` join into `parse(text, is_final=True)`."""

    def __init__(self, parser: ToolParser, seed: str) -> None:
        self.parser = parser
        self.seed = seed
        self.text = ""
        self.sent_content = ""
        self.sent_calls: list[ParsedCall] = []

    def feed(self, text: str) -> list[Delta]:
        self.text += text
        if not text:
            return []
        return self._diff(self.parser.parse(self.text, is_final=False))

    def finish(self) -> list[Delta]:
        return self._diff(self.parser.parse(self.text, is_final=True))

    def _diff(self, parsed: ParsedOutput) -> list[Delta]:
        out: list[Delta] = []
        content = parsed.content or ""
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            out.append({"content": content[len(self.sent_content) :]})
            self.sent_content = content
        for index, call in enumerate(parsed.calls):
            if index >= len(self.sent_calls):
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call_id(self.seed, index),
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
                self.sent_calls.append(ParsedCall(call.name, ""))
            sent = self.sent_calls[index]
            if call.name == sent.name and call.arguments.startswith(sent.arguments):
                fragment = call.arguments[len(sent.arguments) :]
                if fragment:
                    out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
                    self.sent_calls[index] = call
        return out


def join_deltas(deltas: list[Delta]) -> tuple[str, list[dict[str, str]]]:
    """The content and the calls ({id, name, arguments}) that a list of deltas adds up to, as a
    client assembles them (for tests and checks)."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = part.get("id") or call["id"]
            function = part.get("function") or {}
            call["name"] += function.get("name") or ""
            call["arguments"] += function.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]
