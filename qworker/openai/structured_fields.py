"""The body fields that constrain a row's output, mapped onto `SamplingParams.structured_outputs`:
OpenAI's `response_format` (text, json_object, json_schema) and forced `tools`, and vLLM's
`structured_outputs`. One constraint per row; a value qworker cannot honour is a RowError, never
a silent unconstrained run.

Tools (`tools`, `tool_choice`, `parallel_tool_calls`), as OpenAI defines them:

- `tool_choice` "auto" (the default when tools are given): the model decides; its text is read
  for calls by the tool-call parser (openai/tool_parsers.py), no constraint is added.
- "required" or a named function: the output is constrained to the function's `parameters`
  schema; with "required" and several functions, to `{"name": <one of them>, "arguments": <its
  parameters>}`, and read as that call.
- "none": the tools are neither shown nor read for.

A function with `strict: true` gets a closed arguments schema, as OpenAI's strict mode has it:
`additionalProperties: false` and every property required, in every object of the schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from qworker.openai.format import RowError
from qworker.openai.tool_parsers import FORCED_ARGUMENTS, FORCED_WRAPPED, ToolCalling

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
    # Tool definitions to show the model (the job's `tools`).
    tools: list[dict[str, Any]] | None
    # How the output is read for calls; None: it is not.
    tool_calling: ToolCalling | None = None


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
        if function.get("strict") not in (None, True, False):
            raise RowError(f"{where}.function.strict must be true or false", param=where)
        out[name] = closed_schema(parameters) if function.get("strict") else parameters
    return out


# Keywords whose value is one schema, a list of schemas, or a name -> schema map.
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's strict mode: every object schema in `schema` gets `additionalProperties: false`
    and all its properties required (a copy; walked without recursion, so depth is no risk)."""
    root = dict(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        properties = node.get("properties")
        is_object = node.get("type") == "object" or (
            isinstance(node.get("type"), list) and "object" in node["type"]
        )
        if is_object or isinstance(properties, dict):
            node["additionalProperties"] = False
            if isinstance(properties, dict):
                node["required"] = list(properties)
        for key in _ONE_SCHEMA:
            if isinstance(node.get(key), dict):
                node[key] = dict(node[key])
                stack.append(node[key])
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [dict(v) if isinstance(v, dict) else v for v in node[key]]
                stack.extend(v for v in node[key] if isinstance(v, dict))
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {k: dict(v) if isinstance(v, dict) else v for k, v in node[key].items()}
                stack.extend(v for v in node[key].values() if isinstance(v, dict))
    return root


def _forced_names(tool_choice: Any, names: list[str]) -> list[str] | None:
    """The functions a forced choice allows; None for "none" and "auto"."""
    if tool_choice in (None, "none", "auto"):
        return None
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
        'tool_choice must be "none", "auto", "required" or {type: "function", function: {name}}',
        param="tool_choice",
    )


def output_constraint(body: dict[str, Any], tool_call_parser: str | None = None) -> OutputConstraint:
    """The row's constraint from response_format, structured_outputs, tools and tool_choice.
    `tool_call_parser`: the parser that reads calls under tool_choice "auto" (None: none can, and
    "auto" is a 400)."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.get("response_format") is not None:
        constraint = _response_format(body["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    if body.get("structured_outputs") is not None:
        if not isinstance(body["structured_outputs"], dict):
            raise RowError("structured_outputs must be an object", param="structured_outputs")
        found.append(("structured_outputs", body["structured_outputs"]))
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise RowError(
            f"parallel_tool_calls must be true or false, got {parallel!r}", param="parallel_tool_calls"
        )
    forced: ForcedTool | None = None
    tools_shown = None
    tool_calling = None
    tool_choice = body.get("tool_choice")
    if body.get("tools") not in (None, []):
        parameters = _tools(body["tools"])
        names = _forced_names(tool_choice, list(parameters))
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
            parser = FORCED_WRAPPED if forced.is_wrapped else FORCED_ARGUMENTS
            tool_calling = ToolCalling(parser, forced.names)
        elif tool_choice != "none":  # "auto", OpenAI's default when tools are given
            if tool_call_parser is None:
                raise RowError(
                    'tool_choice "auto" needs a tool-call parser, and none was found for this model\'s '
                    "chat template: start the gateway with --tool-call-parser (hermes, llama3_json, "
                    'mistral), or use tool_choice "required" or a named function',
                    param="tool_choice",
                    code="unsupported_parameter",
                )
            tools_shown = list(body["tools"])
            tool_calling = ToolCalling(tool_call_parser, tuple(parameters), parallel is not False)
    elif tool_choice not in (None, "none", "auto"):
        raise RowError("tool_choice needs tools", param="tool_choice")
    if len(found) > 1:
        names_found = " and ".join(name for name, _ in found)
        raise RowError(f"{names_found} each constrain the output; give one", param=found[1][0])
    return OutputConstraint(found[0][1] if found else None, forced, tools_shown, tool_calling)
