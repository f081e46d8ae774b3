"""Closed JSON objects (issue 43 item 4): the schema transform (closed_objects.py), the
`disable_additional_properties` option on a spec and an engine, and the grammar llguidance builds
from it, checked token by token with SmolLM2's tokenizer (no model)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from qworker.config import EngineConfig
from qworker.engine.structured import StructuredOutputError, StructuredOutputs
from qworker.engine.structured.closed_objects import close_objects

OPTIONAL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


def test_an_object_that_names_properties_is_closed_and_the_argument_is_not_changed():
    original = copy.deepcopy(OPTIONAL)
    assert close_objects(OPTIONAL) == {**OPTIONAL, "additionalProperties": False}
    assert original == OPTIONAL


@pytest.mark.parametrize("additional", [True, False, {"type": "integer"}])
def test_an_explicit_additional_properties_is_kept(additional):
    schema = {"type": "object", "properties": {"a": {}}, "additionalProperties": additional}
    assert close_objects(schema) == schema


def test_pattern_properties_close_an_object_and_a_bare_object_stays_open():
    assert close_objects({"patternProperties": {"^x": {}}})["additionalProperties"] is False
    assert close_objects({"type": "object"}) == {"type": "object"}
    assert close_objects({"type": "object", "required": ["a"]}) == {"type": "object", "required": ["a"]}


def test_nested_objects_items_combinators_and_ref_targets_are_closed():
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "child": copy.deepcopy(inner),
            "list": {"type": "array", "items": copy.deepcopy(inner)},
            "tuple": {"type": "array", "prefixItems": [copy.deepcopy(inner)]},
            "either": {"anyOf": [copy.deepcopy(inner), {"type": "null"}]},
            "one": {"oneOf": [copy.deepcopy(inner)]},
            "all": {"allOf": [copy.deepcopy(inner)]},
            "ref": {"$ref": "#/$defs/Point"},
            "old_ref": {"$ref": "#/definitions/Old"},
            "map": {"type": "object", "additionalProperties": copy.deepcopy(inner)},
            "pattern": {"type": "object", "patternProperties": {"^p": copy.deepcopy(inner)}},
        },
        "$defs": {"Point": copy.deepcopy(inner)},
        "definitions": {"Old": copy.deepcopy(inner)},
    }
    closed = close_objects(schema)
    props = closed["properties"]
    every_inner = [
        props["child"],
        props["list"]["items"],
        props["tuple"]["prefixItems"][0],
        props["either"]["anyOf"][0],
        props["one"]["oneOf"][0],
        props["all"]["allOf"][0],
        props["map"]["additionalProperties"],
        props["pattern"]["patternProperties"]["^p"],
        closed["$defs"]["Point"],
        closed["definitions"]["Old"],
    ]
    assert closed["additionalProperties"] is False
    assert all(node["additionalProperties"] is False for node in every_inner)
    # The map keeps its own schema for unnamed keys; the ref holders are not objects themselves.
    assert props["map"]["additionalProperties"]["properties"] == inner["properties"]
    assert "additionalProperties" not in props["ref"]


def test_data_and_a_property_named_properties_are_not_rewritten():
    data = {"properties": {"a": 1}}
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"q": {}}}},
        "const": data,
        "enum": [data],
        "default": data,
        "examples": [data],
    }
    closed = close_objects(schema)
    # The property called "properties" is a schema (closed); the mapping holding it is not.
    assert set(closed["properties"]) == {"properties"}
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["const"] == closed["default"] == data and closed["enum"] == closed["examples"] == [data]


def test_the_spec_option_is_checked_keyed_and_carried():
    spec = StructuredOutputs.from_value({"json": OPTIONAL, "disable_additional_properties": False})
    assert spec.disable_additional_properties is False
    assert StructuredOutputs.from_value(spec.to_dict()) == spec
    keys = {
        StructuredOutputs(json=OPTIONAL, disable_additional_properties=value).cache_key
        for value in (None, True, False)
    }
    assert len(keys) == 3
    assert "disable_additional_properties" not in StructuredOutputs(json=OPTIONAL).to_dict()
    with pytest.raises(StructuredOutputError, match="disable_additional_properties: must be true, false"):
        StructuredOutputs(json=OPTIONAL, disable_additional_properties="yes")  # type: ignore[arg-type]
    with pytest.raises(StructuredOutputError, match="disable_additional_properties: applies to json only"):
        StructuredOutputs(regex="a+", disable_additional_properties=True)


def test_the_engine_option_is_on_by_default():
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert defaults["disable_additional_properties"] is True


# -- the grammar llguidance builds: SmolLM2's tokenizer, no model ----------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from qworker.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2").path)


def accepts(backend, spec: StructuredOutputs, text: str, tokenizer) -> bool:
    """Whether a fresh matcher takes every token of `text` and may then stop."""
    matcher = backend.compile(spec).new_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize("engine_default", [True, False])
def test_the_grammar_refuses_unnamed_keys_unless_told_otherwise(tokenizer, engine_default):
    pytest.importorskip("llguidance")
    from qworker.engine.structured.backend import LLGuidanceBackend

    eos = [tokenizer.eos_token_id]
    backend = LLGuidanceBackend(tokenizer, len(tokenizer), eos, disable_additional_properties=engine_default)
    nested = {"type": "object", "properties": {"point": {"$ref": "#/$defs/P"}}, "$defs": {"P": OPTIONAL}}
    named, padded = '{"name": "Ann", "age": 3}', '{"name": "Ann", "extra": 1}'
    nested_padded = '{"point": {"age": 3, "zzz": true}}'
    for closing in (None, True, False):
        closed = closing if closing is not None else engine_default
        spec = StructuredOutputs(json=OPTIONAL, disable_additional_properties=closing)
        assert accepts(backend, spec, named, tokenizer)
        assert accepts(backend, spec, padded, tokenizer) is not closed, (closing, engine_default)
        nested_spec = StructuredOutputs(json=nested, disable_additional_properties=closing)
        assert accepts(backend, nested_spec, nested_padded, tokenizer) is not closed
    # A schema that allows more keeps allowing them; a bare object stays open.
    allowing = {**OPTIONAL, "additionalProperties": {"type": "integer"}}
    assert accepts(backend, StructuredOutputs(json=allowing), '{"extra": 1}', tokenizer)
    assert not accepts(backend, StructuredOutputs(json=allowing), '{"extra": "x"}', tokenizer)
    assert accepts(backend, StructuredOutputs(json={"type": "object"}), json.dumps({"any": 1}), tokenizer)


def test_a_schema_that_closing_makes_unsatisfiable_compiles_as_written(tokenizer):
    pytest.importorskip("llguidance")
    from qworker.engine.structured.backend import LLGuidanceBackend

    backend = LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    # "b" is required but named only in the allOf branch: closing the outer object forbids it.
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a", "b"],
        "allOf": [{"properties": {"b": {"type": "integer"}}}],
    }
    spec = StructuredOutputs(json=schema)
    with pytest.raises(StructuredOutputError):
        backend._compile(spec, close=True)
    assert accepts(backend, spec, '{"a": 1, "b": 2}', tokenizer)
