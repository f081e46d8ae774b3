"""What a request asks its output to match: `SamplingParams.structured_outputs`.

Plain data and plain-Python checks: nothing here imports a grammar backend, so the engine, the
job schema and the batch rows can validate a constraint on a machine without llguidance. The
checks bound what a request may bring (size, nesting depth) before anything is compiled; what
the backend then refuses fails the request alone (see compiler.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from qworker.errors import InvalidParamsError

# A constraint's canonical text above this is refused before compiling (1 MiB; a 5 MB schema is
# a mistake or an attack, and real-world schemas in SchemaStore stay under 300 kB).
MAX_CONSTRAINT_CHARS = 1 << 20
# Nesting depth of a JSON Schema (objects and arrays); the deepest SchemaStore schema we ship
# nests 21 levels. Bounds the compiler's recursion and the canonical dump.
MAX_SCHEMA_DEPTH = 128
MAX_CHOICES = 10_000

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(InvalidParamsError):
    """A structured-output constraint that cannot be used: malformed, too large, or refused by
    the grammar backend. The message names the problem."""


def _depth_problem(value: Any, max_depth: int) -> str | None:
    """Walks without recursion, so a 10,000-level document is refused, not a RecursionError."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: list[Any] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return f"nests deeper than {max_depth} levels"
        stack.extend((child, depth + 1) for child in children)
    return None


def _parse_schema(value: Any) -> dict[str, Any] | bool:
    """A JSON Schema given as an object, a boolean, the word "object", or JSON text."""
    if isinstance(value, bool):
        return {"type": "object"} if value else _refuse("json", "false allows nothing; omit the field")
    if isinstance(value, str):
        if value == "object":
            return {"type": "object"}
        if len(value) > MAX_CONSTRAINT_CHARS:
            _refuse("json", f"the schema has {len(value)} characters; the limit is {MAX_CONSTRAINT_CHARS}")
        try:
            value = json.loads(value)
        except RecursionError:
            _refuse("json", f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        except ValueError as exc:
            _refuse("json", f"the schema is not JSON: {exc}")
        if isinstance(value, bool):
            return _parse_schema(value)
    if not isinstance(value, dict):
        _refuse("json", f"must be a JSON Schema object, true or 'object', got {type(value).__name__}")
    problem = _depth_problem(value, MAX_SCHEMA_DEPTH)
    if problem is not None:
        _refuse("json", f"the schema {problem}")
    return value


def _refuse(name: str, message: str) -> Any:
    raise StructuredOutputError(f"structured_outputs.{name}: {message}")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint on the generated text, with vLLM's field names.

    - `json`: a JSON Schema (an object, or its JSON text); `true` or `"object"` for any JSON
      object. `json_object=True` is the same as `json="object"`.
    - `regex`: the whole output matches this regular expression (Rust `regex` syntax).
    - `choice`: the output is exactly one of these strings.
    - `grammar`: a Lark grammar (llguidance's dialect) or a GBNF/EBNF grammar.
    - `disable_any_whitespace`: JSON without free whitespace between tokens (compact output);
      `whitespace_pattern`: a regex for that whitespace instead. JSON only.
    - `disable_additional_properties`: true, objects that name their properties allow no others
      unless the schema says `additionalProperties` (closed_objects.py); false, the schema is
      followed as JSON Schema reads it (unnamed properties allowed); none, the engine's
      `disable_additional_properties` (true unless set). JSON only.

    A missing constraint, two constraints, or an unknown key raise StructuredOutputError.
    """

    json: dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool | None = None

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputs:
        """From a dict (a job's JSON), or an instance as is."""
        if isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputError(
                f"structured_outputs must be an object with one of {', '.join(CONSTRAINT_KINDS)}, "
                f"got {type(value).__name__}"
            )
        allowed = {f.name for f in fields(cls)} | {"json_object"}
        unknown = sorted(str(k) for k in value if k not in allowed)
        if unknown:
            raise StructuredOutputError(
                f"structured_outputs: unknown field(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(allowed))}"
            )
        kinds = [k for k in CONSTRAINT_KINDS if value.get(k) is not None and value.get(k) is not False]
        if len(kinds) != 1:
            raise StructuredOutputError(
                f"structured_outputs takes exactly one of {', '.join(CONSTRAINT_KINDS)}, "
                f"got {len(kinds)}{': ' + ', '.join(kinds) if kinds else ''}"
            )
        args = {k: v for k, v in value.items() if k != "json_object"}
        if kinds == ["json_object"]:
            if value["json_object"] is not True:
                _refuse("json_object", f"must be true, got {value['json_object']!r}")
            args["json"] = "object"
        return cls(**args)

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise StructuredOutputError(
                f"structured_outputs takes exactly one of json, regex, choice, grammar; got {len(kinds)}"
                f"{': ' + ', '.join(kinds) if kinds else ''}"
            )
        if self.json is not None:
            object.__setattr__(self, "json", _parse_schema(self.json))
        for name in ("regex", "grammar"):
            text = getattr(self, name)
            if text is None:
                continue
            if not isinstance(text, str) or not text:
                _refuse(name, f"must be a non-empty string, got {text!r}")
            if len(text) > MAX_CONSTRAINT_CHARS:
                _refuse(name, f"has {len(text)} characters; the limit is {MAX_CONSTRAINT_CHARS}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                _refuse("choice", f"must be a non-empty list of strings, got {choice!r}")
            if len(choice) > MAX_CHOICES:
                _refuse("choice", f"has {len(choice)} entries; the limit is {MAX_CHOICES}")
            if any(not isinstance(c, str) or not c for c in choice):
                _refuse("choice", "every entry must be a non-empty string")
            if sum(len(c) for c in choice) > MAX_CONSTRAINT_CHARS:
                _refuse("choice", f"the entries total more than {MAX_CONSTRAINT_CHARS} characters")
            object.__setattr__(self, "choice", tuple(choice))
        if not isinstance(self.disable_any_whitespace, bool):
            _refuse("disable_any_whitespace", f"must be true or false, got {self.disable_any_whitespace!r}")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                _refuse("whitespace_pattern", f"must be a non-empty string, got {self.whitespace_pattern!r}")
            if len(self.whitespace_pattern) > 1000:
                _refuse("whitespace_pattern", "is longer than 1000 characters")
        if self.json is None and (self.disable_any_whitespace or self.whitespace_pattern is not None):
            _refuse("disable_any_whitespace", "whitespace options apply to json only")
        closing = self.disable_additional_properties
        if closing is not None and not isinstance(closing, bool):
            _refuse("disable_additional_properties", f"must be true, false or null, got {closing!r}")
        if self.json is None and closing is not None:
            _refuse("disable_additional_properties", "applies to json only")
        # The canonical text is also the cache key; computing it now checks the size once.
        key = self.cache_key
        if len(key) > MAX_CONSTRAINT_CHARS + 200:
            _refuse(self.kind, f"has {len(key)} characters; the limit is {MAX_CONSTRAINT_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    @property
    def cache_key(self) -> str:
        """The constraint's canonical text: equal constraints (whatever their key order or
        spacing) share one compiled grammar."""
        cached = self.__dict__.get("_cache_key")
        if cached is None:
            body: Any = getattr(self, self.kind)
            if self.choice is not None:
                body = list(self.choice)
            options = [
                self.disable_any_whitespace,
                self.whitespace_pattern,
                self.disable_additional_properties,
            ]
            cached = json.dumps([self.kind, body, options], sort_keys=True, separators=(",", ":"))
            object.__setattr__(self, "_cache_key", cached)
        return cached

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a job carries (from_value reads it back)."""
        out: dict[str, Any] = {
            self.kind: list(self.choice) if self.choice is not None else getattr(self, self.kind)
        }
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        if self.whitespace_pattern is not None:
            out["whitespace_pattern"] = self.whitespace_pattern
        if self.disable_additional_properties is not None:
            out["disable_additional_properties"] = self.disable_additional_properties
        return out
