"""Closed JSON objects: `additionalProperties: false` wherever a schema names an object's
properties and says nothing of the others.

JSON Schema lets an object carry any property it does not name (`additionalProperties` defaults
to true), so a grammar built from the schema as written lets a small model keep adding keys and
never close the object. vLLM's default backend (xgrammar, strict mode) allows only the named
properties, and OpenAI's strict mode requires `additionalProperties: false`; vLLM's guidance
backend gets the same with `disable_additional_properties` (its
`process_for_additional_properties`). This is that transform, walking the schema's keywords
rather than every dict, so that data inside `const`, `enum`, `default` or `examples`, and a
property that happens to be called "properties", are never changed.

Rules, as vLLM's:
- an object schema with `properties` or `patternProperties` and no `additionalProperties` gets
  `additionalProperties: false`; one that says `additionalProperties` (true, false or a schema)
  keeps what it says;
- `{"type": "object"}` with neither (and `response_format: json_object`) stays open: closing it
  would allow only `{}`;
- subschemas are walked wherever a keyword holds one: properties, patternProperties, items,
  prefixItems, additionalItems, additionalProperties, contains, anyOf, oneOf, allOf, not,
  if/then/else, dependentSchemas, propertyNames, unevaluated*, $defs and definitions (so a `$ref`
  target is closed where it is defined).

Every output of the closed schema is valid against the original one: a closed object is one of
the objects the open one allows. The one place where that shrinks the language more than
intended is `allOf` over objects that each name some of the properties: each branch is closed on
its own names, as vLLM's transform closes it, so an instance may carry only properties every
closed branch names; write `additionalProperties: true` in such branches to keep them open.
"""

from __future__ import annotations

import copy
from typing import Any

# Keywords whose value is one subschema, or a list of subschemas.
_SCHEMA_KEYWORDS = (
    "items",
    "prefixItems",
    "additionalItems",
    "additionalProperties",
    "contains",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
# Keywords whose value maps names to subschemas.
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose objects allow only the properties they name (rules above). The
    argument is not changed."""
    closed = copy.deepcopy(schema)
    # Without recursion: spec.py bounds the depth, but a stack costs nothing here.
    stack: list[Any] = [closed]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue  # true / false schemas, or a malformed keyword the backend will name
        if "additionalProperties" not in node and ("properties" in node or "patternProperties" in node):
            node["additionalProperties"] = False
        for keyword in _SCHEMA_KEYWORDS:
            if keyword in node:
                stack.append(node[keyword])
        for keyword in _SCHEMA_MAP_KEYWORDS:
            mapping = node.get(keyword)
            if isinstance(mapping, dict):
                stack.extend(mapping.values())
    return closed
