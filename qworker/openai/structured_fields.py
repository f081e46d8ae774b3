"""The body fields that constrain a row's output, mapped onto `SamplingParams.structured_outputs`:
OpenAI's `response_format` (text, json_object, json_schema) and forced `tools`, and vLLM's
`structured_outputs`. One constraint per row; a value qworker cannot honour is a RowError, never
a silent unconstrained run.

A forced tool call (`tool_choice` "required" or a named function) constrains the output to the
function's `parameters` schema; with "required" and several functions, to
`{"name": <one of them>, "arguments": <its parameters>}`. The output then becomes OpenAI's
`tool_calls` (`forced_tool_calls`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from qworker.openai.format import RowError

# OpenAI's rule for function and json_schema names.
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
# A function without parameters takes an empty object.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ForcedTool:
    """The functions a row's output must call; wrapped: the output is {"name", "arguments"}."""

    names: tuple[str, ...]

    @property
    def is_wrapped(self) -> bool:
        return len(self.names) > 1


@dataclass(frozen=True)
class OutputConstraint:
    # The value for SamplingParams.structured_outputs; None: unconstrained.
    structured_outputs: dict[str, Any] | None
    forced_tool: ForcedTool | None
    # Tool definitions to show the model (a system message), for a forced call.
    tools: list[dict[str, Any]] | None


def _response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        raise RowError(
            f"response_format must be an object with type {', '.join(RESPONSE_FORMAT_TYPES)}; got {value!r}"[
                :300
            ],
            param="response_format",
        )
    kind = value["type"]
    extra = sorted(set(value) - {"type", kind if kind == "json_schema" else "type"})
    if extra:
        raise RowError(f"response_format: unknown field(s) {', '.join(extra)}", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json": "object"}
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise RowError(f"{where} must be an object with name and schema", param=where)
    unknown = sorted(set(spec) - JSON_SCHEMA_FIELDS)
    if unknown:
        raise RowError(f"{where}: unknown field(s) {', '.join(unknown)}", param=where)
    name = spec.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise RowError(f"{where}.name must match {NAME_PATTERN.pattern}, got {name!r}", param=f"{where}.name")
    if spec.get("strict") not in (None, True, False):
        raise RowError(f"{where}.strict must be true or false", param=f"{where}.strict")
    # strict or not, the output follows the schema: qworker always decodes under the grammar.
    schema = spec.get("schema", {"type": "object"})
    return {"json": schema}


def _tools(value: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, in order."""
    if not isinstance(value, list) or not value:
        raise RowError("tools must be a non-empty list of {type: function, function: {...}}", param="tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - TOOL_FIELDS:
            raise RowError(
                f"{where} must be {{type: 'function', function: {{name, parameters}}}}", param=where
            )
        function = tool.get("function")
        if not isinstance(function, dict) or set(function) - FUNCTION_FIELDS:
            raise RowError(f"{where}.function must hold name, description, parameters, strict", param=where)
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise RowError(
                f"{where}.function.name must match {NAME_PATTERN.pattern}, got {name!r}", param=where
            )
        if name in out:
            raise RowError(f"{where}: the function {name!r} is defined twice", param=where)
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise RowError(f"{where}.function.parameters must be a JSON Schema object", param=where)
        out[name] = parameters
    return out


def _forced_names(tool_choice: Any, names: list[str]) -> list[str] | None:
    if tool_choice in (None, "none"):
        return None
    if tool_choice == "auto":
        raise RowError(
            'tool_choice "auto" is not supported: use "required" or name a function',
            param="tool_choice",
            code="unsupported_parameter",
        )
    if tool_choice == "required":
        return names
    if (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and set(tool_choice) == {"type", "function"}
    ):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise RowError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return [name]
    raise RowError(
        'tool_choice must be "none", "required" or {type: "function", function: {name}}', param="tool_choice"
    )


def output_constraint(body: dict[str, Any]) -> OutputConstraint:
    """The row's constraint from response_format, structured_outputs, tools and tool_choice."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.get("response_format") is not None:
        constraint = _response_format(body["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    if body.get("structured_outputs") is not None:
        if not isinstance(body["structured_outputs"], dict):
            raise RowError("structured_outputs must be an object", param="structured_outputs")
        found.append(("structured_outputs", body["structured_outputs"]))
    forced: ForcedTool | None = None
    tools_shown = None
    if body.get("tools") not in (None, []):
        parameters = _tools(body["tools"])
        names = _forced_names(body.get("tool_choice"), list(parameters))
        if names is not None:
            forced = ForcedTool(tuple(names))
            tools_shown = [t for t in body["tools"] if t["function"]["name"] in names]
            if forced.is_wrapped:
                schema: dict[str, Any] = {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"name": {"const": name}, "arguments": parameters[name]},
                            "required": ["name", "arguments"],
                            "additionalProperties": False,
                        }
                        for name in names
                    ]
                }
            else:
                schema = parameters[names[0]]
            found.append(("tools", {"json": schema}))
    elif body.get("tool_choice") not in (None, "none", "auto"):
        raise RowError("tool_choice needs tools", param="tool_choice")
    if len(found) > 1:
        names_found = " and ".join(name for name, _ in found)
        raise RowError(f"{names_found} each constrain the output; give one", param=found[1][0])
    return OutputConstraint(found[0][1] if found else None, forced, tools_shown)


def tools_system_message(tools: list[dict[str, Any]]) -> dict[str, str]:
    """A system message that shows the model the functions it must call (chat templates that
    take `tools` render their own; SmolLM2's takes none)."""
    listed = json.dumps([t["function"] for t in tools], separators=(",", ":"))
    return {"role": "system", "content": f"Reply with a call to one of these functions, as JSON: {listed}"}


def forced_tool_calls(forced: ForcedTool, text: str, call_id_seed: str) -> list[dict[str, Any]] | None:
    """OpenAI's tool_calls for a completed output under a forced tool; None when the text is not
    a call (an output cut at max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if forced.is_wrapped:
        if not isinstance(value, dict) or value.get("name") not in forced.names:
            return None
        name, arguments = value["name"], value.get("arguments", {})
    else:
        name, arguments = forced.names[0], value
    call_id = "call_" + uuid.uuid5(uuid.NAMESPACE_OID, call_id_seed).hex[:24]
    return [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    ]
