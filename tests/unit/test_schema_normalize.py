"""Schema normalisation: older drafts' forms, allOf merges, siblings of anyOf, bounded numbers; and no
keyword loosened silently: each one the grammar cannot enforce is refused naming it and its JSON pointer
(a 400 through the server's fields), or reported in best-effort mode."""

from __future__ import annotations

import re

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.structured_fields import FieldError, request_structured_outputs
from llmserve.server.protocol import ChatCompletionRequest
from llmserve.structured.grammar import build_grammar, unenforced_keywords
from llmserve.structured.schema_normalize import INT64_MAX, SchemaKeywordError, escape_pattern, normalize

import msgspec

REFUSED = [  # (keyword family, schema, keyword, pointer)
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "/uniqueItems"),
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "not", "/properties/a/not"),
    ("if-then-else", {"if": {"type": "integer"}, "then": {"minimum": 3}}, "if", "/if"),
    ("dependentSchemas", {"type": "object", "dependencies": {"a": {"required": ["b"]}}}, "dependentSchemas",
     "/dependentSchemas"),
    ("oneOf overlapping", {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf", "/oneOf"),
    ("minContains", {"type": "array", "items": {"type": "integer"}, "contains": {"type": "integer"},
                     "minContains": 2}, "minContains",
     "/minContains"),
    ("unevaluatedProperties", {"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties",
     "/unevaluatedProperties"),
    ("remote $ref", {"$ref": "https://example.com/s.json"}, "$ref", "/$ref"),
    ("allOf conflict", {"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]}, "allOf", "/allOf/1"),
]


def _accepts(schema, text: str, **options) -> bool:
    params = StructuredOutputsParams.from_json_schema(schema, **options)
    return _is_grammar_accept_string(build_grammar(params), text)


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_unenforceable_keyword_is_refused_by_name(case):
    _, schema, keyword, pointer = case
    with pytest.raises(ValueError, match=re.escape(f"'{keyword}' at {pointer}")):
        build_grammar(StructuredOutputsParams.from_json_schema(schema))


@pytest.mark.parametrize("case", REFUSED[:-1], ids=[c[0] for c in REFUSED[:-1]])
def test_best_effort_reports_what_it_does_not_enforce(case):
    _, schema, keyword, pointer = case
    params = StructuredOutputsParams.from_json_schema(schema, best_effort=True)
    build_grammar(params)
    assert f"{keyword} at {pointer}" in unenforced_keywords(params)


def _request(body):
    return request_structured_outputs(msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}, ChatCompletionRequest))


def test_refusal_is_a_field_error_naming_the_schema_field():
    schema = {"type": "array", "uniqueItems": True}
    with pytest.raises(FieldError, match="uniqueItems' at /uniqueItems") as e:
        _request({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert e.value.param == "response_format.json_schema.schema"
    params = _request({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                       "structured_outputs": {"best_effort": True}})
    assert params.best_effort and unenforced_keywords(params) == ["uniqueItems at /uniqueItems"]


def test_strict_false_allows_unnamed_properties_and_bare_min_items():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not _accepts(schema, '{"b": 1}')
    assert _accepts(schema, '{"b": 1}', strict=False)
    assert _accepts({"type": "array", "minItems": 2}, "[1, 2]", strict=False)


def test_older_drafts_forms():
    out = normalize({"definitions": {"x": {"type": "integer"}}, "type": "object",
                     "properties": {"t": {"items": [{"$ref": "#/definitions/x"}], "additionalItems": False},
                                    "n": {"type": "number", "minimum": 0, "exclusiveMinimum": True}},
                     "dependencies": {"a": ["b"]}}).schema
    assert out["$defs"] == {"x": {"type": "integer", "minimum": -(2**63), "maximum": INT64_MAX}}
    assert out["properties"]["t"]["prefixItems"] == [{"$ref": "#/$defs/x"}] and out["properties"]["t"]["items"] is False
    assert out["properties"]["n"]["exclusiveMinimum"] == 0 and "minimum" not in out["properties"]["n"]
    assert out["dependentRequired"] == {"a": ["b"]}
    assert _accepts({"items": [{"type": "integer"}, {"type": "string"}]}, '[1, "a"]')


def test_pattern_control_characters_escaped():
    assert escape_pattern("^[^\n]*$") == "^[^\\n]*$"
    assert _accepts({"type": "string", "pattern": "^[^\n]*$"}, '"ab"')


def test_all_of_merged_and_siblings_of_any_of_enforced():
    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                          {"properties": {"b": {"type": "string"}}}]}
    assert _accepts(schema, '{"a": 1, "b": "x"}') and not _accepts(schema, "1") and not _accepts(schema, '{}')
    beside = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "anyOf": [{"properties": {"c": {"type": "string"}}}]}
    assert not _accepts(beside, "{}") and _accepts(beside, '{"a": 1}')
    with pytest.raises(SchemaKeywordError):
        normalize({"allOf": [{"type": "string"}, {"type": "integer"}]})


def test_unique_items_of_at_most_one_item_holds():
    assert not normalize({"type": "array", "maxItems": 1, "uniqueItems": True}).unenforced


def test_discriminated_one_of_is_exclusive():
    branch = lambda kind: {"type": "object", "required": ["kind"], "properties": {"kind": {"const": kind}}}
    assert not normalize({"oneOf": [branch("a"), branch("b")]}).unenforced
    assert normalize({"oneOf": [branch("a"), branch("a")]}).unenforced[0].keyword == "oneOf"


def test_type_list_keeps_each_types_keywords():
    schema = {"type": ["string", "null"], "maxLength": 3}
    assert _accepts(schema, '"ab"') and _accepts(schema, "null") and not _accepts(schema, '"abcd"')
    assert not _accepts(schema, '"a\nb"'.replace("\\n", "\n"))


def _accepts_bytes(schema, data: bytes) -> bool:
    return _is_grammar_accept_string(build_grammar(StructuredOutputsParams.from_json_schema(schema)), data)


@pytest.mark.parametrize("bounds", [{"maxLength": 3}, {"minLength": 1}, {"minLength": 1, "maxLength": 3}])
def test_length_bounded_strings_hold_only_json_characters(bounds):
    """xgrammar writes such a string's characters as a class that lets raw control characters through (invalid
    JSON); ours takes what JSON takes unescaped, as whole UTF-8 characters, counted as characters."""
    schema = {"type": "string", **bounds}
    assert _accepts(schema, '"ab"') and _accepts(schema, '"é😀"') and _accepts(schema, '"\x7f"')
    for control in ("\t", "\x01", "\x1f", "\n", "\r"):
        assert not _accepts(schema, f'"a{control}"'), repr(control)
    for raw in (b'"\xed\xa0\x80"', b'"\x80"', b'"\xc0\xaf"'):  # a surrogate, a lone continuation, overlong
        assert not _accepts_bytes(schema, raw), raw
    assert not _accepts(schema, '"a\\"b"') and not _accepts(schema, '"a\\\\"')  # no escapes (as xgrammar's)
    if "maxLength" in bounds:
        assert _accepts(schema, '"😀😀😀"') and not _accepts(schema, '"😀😀😀😀"')
    else:
        assert not _accepts(schema, '""')


def test_numbers_bounded():
    assert _accepts({"type": "integer"}, str(INT64_MAX)) and not _accepts({"type": "integer"}, "1" * 20)
    assert not _accepts({"type": "number"}, "1" * 17) and not _accepts({"type": "number"}, "1.5e300")
    assert _accepts({"type": "number"}, "-12.25")
    assert _accepts({"type": "integer", "minimum": 0}, "9" * 19) is False  # int64's max still holds
    assert normalize({"type": "integer"}, bound_numbers=False).schema == {"type": "integer"}


def test_a_request_may_leave_numbers_to_the_schema():
    """structured_outputs.bound_numbers false: the schema's own bounds only (the grammar then takes 20 digits)."""
    assert _accepts({"type": "integer"}, "1" * 20, bound_numbers=False)
    assert not _accepts({"type": "integer", "maximum": 5}, "6", bound_numbers=False)
    bounded, unbounded = (StructuredOutputsParams.from_json_schema({"type": "integer"}, bound_numbers=b)
                          for b in (True, False))
    assert bounded.cache_key != unbounded.cache_key  # two grammars
