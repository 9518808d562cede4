"""Request fields that constrain the output -> StructuredOutputsParams: every accepted form, every refusal
(a ValueError naming the field, answered 400 with `param`). No server, no tokenizer."""

from __future__ import annotations

import json

import msgspec
import pytest

from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import to_api_error
from llmserve.server.params import chat_overrides, completion_overrides
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest, decode_json
from llmserve.server.serving_tgi import TGIRequest, tgi_overrides
from llmserve.server.structured_fields import FieldError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CANONICAL = json.dumps(SCHEMA, separators=(",", ":"))  # key order kept: properties come out in it
NAMED = {"name": "thing", "schema": SCHEMA}


def completion(body: dict) -> StructuredOutputsParams | None:
    req = decode_json(json.dumps({"prompt": "x", **body}).encode(), CompletionRequest)
    return completion_overrides(req)["structured_outputs"]


def chat(body: dict) -> StructuredOutputsParams | None:
    req = decode_json(json.dumps({"messages": [{"role": "user", "content": "x"}], **body}).encode(),
                      ChatCompletionRequest)
    return chat_overrides(req)["structured_outputs"]


def tgi(parameters: dict) -> StructuredOutputsParams | None:
    req = decode_json(json.dumps({"inputs": "x", "parameters": parameters}).encode(), TGIRequest)
    return tgi_overrides(req.parameters)["structured_outputs"]


BOTH = [completion, chat]

ACCEPTED = [
    ("none", {}, None),
    ("rf-text", {"response_format": {"type": "text"}}, None),
    ("rf-json-object", {"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ("rf-json-schema", {"response_format": {"type": "json_schema", "json_schema": NAMED}},
     StructuredOutputsParams(json=CANONICAL)),
    ("rf-json-schema-strict", {"response_format": {"type": "json_schema", "json_schema": {
        **NAMED, "strict": True, "description": "a thing"}}}, StructuredOutputsParams(json=CANONICAL)),
    ("rf-json-schema-not-strict", {"response_format": {"type": "json_schema", "json_schema": {
        **NAMED, "strict": False}}}, StructuredOutputsParams(json=CANONICAL, strict=False)),
    ("so-json-object", {"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=CANONICAL)),
    ("rf-not-strict-closed", {"response_format": {"type": "json_schema", "json_schema": {**NAMED, "strict": False}},
                              "structured_outputs": {"disable_additional_properties": True}},
     StructuredOutputsParams(json=CANONICAL, strict=True)),
    ("so-best-effort", {"guided_json": SCHEMA, "structured_outputs": {"best_effort": True}},
     StructuredOutputsParams(json=CANONICAL, best_effort=True)),
    ("so-unbounded-numbers", {"guided_json": SCHEMA, "structured_outputs": {"bound_numbers": False}},
     StructuredOutputsParams(json=CANONICAL, bound_numbers=False)),
    ("so-json-text", {"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=CANONICAL)),
    ("so-regex", {"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ("so-choice", {"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
    ("so-grammar", {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
     StructuredOutputsParams(grammar='root ::= "a" | "b"')),
    ("so-json-object-flag", {"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ("so-no-whitespace", {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=CANONICAL, disable_any_whitespace=True)),
    ("so-neutral-options", {"structured_outputs": {"regex": "a", "disable_fallback": True, "json_object": False,
                                                   "disable_additional_properties": False}},
     StructuredOutputsParams(regex="a")),
    ("so-whitespace-with-rf", {"response_format": {"type": "json_object"},
                               "structured_outputs": {"disable_any_whitespace": True}},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ("guided-json", {"guided_json": SCHEMA}, StructuredOutputsParams(json=CANONICAL)),
    ("guided-json-text", {"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=CANONICAL)),
    ("guided-regex", {"guided_regex": r"\d{3}"}, StructuredOutputsParams(regex=r"\d{3}")),
    ("guided-choice", {"guided_choice": ["a", "b c"]}, StructuredOutputsParams(choice=["a", "b c"])),
    ("guided-grammar", {"guided_grammar": 'root ::= "x"+'}, StructuredOutputsParams(grammar='root ::= "x"+')),
    ("guided-backend", {"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
     StructuredOutputsParams(regex="a")),
    ("guided-backend-auto-alone", {"guided_decoding_backend": "auto"}, None),
]


@pytest.mark.parametrize("endpoint", BOTH)
@pytest.mark.parametrize("case", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_forms(endpoint, case):
    _, body, expected = case
    assert endpoint(body) == expected


def test_the_sampling_params_carry_it():
    req = decode_json(b'{"prompt": "x", "guided_choice": ["a", "b"]}', CompletionRequest)
    params = SamplingParams(**completion_overrides(req))
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    # it crosses to the engine as msgpack
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}
REFUSED = [
    # (id, body, the param named, text in the message)
    ("rf-unknown-type", {"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ("rf-no-type", {"response_format": {}}, "response_format", "type"),
    ("rf-schema-missing", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("rf-no-name", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema", "name"),
    ("rf-bad-name", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name", "name"),
    ("rf-long-name", {"response_format": {"type": "json_schema", "json_schema": {"name": "a" * 65,
                                                                                  "schema": SCHEMA}}},
     "response_format.json_schema.name", "name"),
    ("rf-no-schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema", "schema"),
    ("rf-bad-schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": BAD_SCHEMA}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ("rf-text-with-schema", {"response_format": {"type": "text", "json_schema": NAMED}},
     "response_format.json_schema", "json_schema"),
    ("rf-unknown-key", {"response_format": {"type": "json_schema", "json_schema": {**NAMED, "x": 1}}},
     "response_format.json_schema.x", "x"),
    ("so-bad-schema", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json", "invalid JSON schema"),
    ("so-schema-not-json", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ("so-bad-regex", {"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "invalid regex"),
    ("so-bad-grammar", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "grammar"),
    ("so-empty-choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "choice"),
    ("so-two-kinds", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("so-whitespace-pattern", {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ("so-structural-tag", {"structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag", "not supported"),
    ("so-additional-properties-alone", {"structured_outputs": {"disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties", "applies to a JSON schema"),
    ("so-unbounded-regex", {"structured_outputs": {"regex": "[0-9]+", "bound_numbers": False}},
     "structured_outputs.bound_numbers", "applies to a JSON schema"),
    ("so-backend", {"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend",
     "backend"),
    ("so-whitespace-alone", {"structured_outputs": {"disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "JSON"),
    ("so-whitespace-regex", {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "JSON"),
    ("guided-bad-json", {"guided_json": BAD_SCHEMA}, "guided_json", "invalid JSON schema"),
    ("guided-json-array", {"guided_json": "[1]"}, "guided_json", "object"),
    ("guided-bad-regex", {"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
    ("guided-empty-regex", {"guided_regex": ""}, "guided_regex", "non-empty"),
    ("guided-bad-choice", {"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
    ("guided-bad-grammar", {"guided_grammar": "root ::= "}, "guided_grammar", "grammar"),
    ("guided-backend", {"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "outlines"),
    ("guided-whitespace", {"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "guided_whitespace_pattern"),
    ("two-rf-guided", {"response_format": {"type": "json_schema", "json_schema": NAMED}, "guided_regex": "a"},
     "guided_regex", "only one"),
    ("two-so-guided", {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "only one"),
    ("two-guided", {"guided_json": SCHEMA, "guided_grammar": 'root ::= "a"'}, "guided_grammar", "only one"),
    ("two-rf-so", {"response_format": {"type": "json_object"}, "structured_outputs": {"json_object": True}},
     "structured_outputs", "only one"),
    ("unknown-guided", {"guided_json_object": True}, "guided_json_object", "guided_json_object"),
]


@pytest.mark.parametrize("endpoint", BOTH)
@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_forms(endpoint, case):
    _, body, param, text = case
    with pytest.raises(ValueError) as e:
        endpoint(body)
    err = to_api_error(e.value)
    assert (err.status, err.param) == (400, param), err.message
    assert text.lower() in err.message.lower()


def test_field_errors_name_their_field():
    with pytest.raises(FieldError) as e:
        completion({"guided_regex": "a("})
    assert e.value.param == "guided_regex" and str(e.value).startswith("guided_regex: invalid regex")


TGI_ACCEPTED = [
    ("none", {}, None),
    ("json", {"grammar": {"type": "json", "value": SCHEMA}}, StructuredOutputsParams(json=CANONICAL)),
    ("json-text", {"grammar": {"type": "json", "value": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=CANONICAL)),
    ("json-object-alias", {"grammar": {"type": "json_object", "value": SCHEMA}},
     StructuredOutputsParams(json=CANONICAL)),
    ("regex", {"grammar": {"type": "regex", "value": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
]


@pytest.mark.parametrize("case", TGI_ACCEPTED, ids=[c[0] for c in TGI_ACCEPTED])
def test_tgi_grammar(case):
    _, parameters, expected = case
    assert tgi(parameters) == expected


TGI_REFUSED = [
    ("unknown-type", {"grammar": {"type": "ebnf", "value": "root ::= x"}}, "parameters.grammar.type", "ebnf"),
    ("no-value", {"grammar": {"type": "regex"}}, "parameters.grammar", "value"),
    ("regex-not-string", {"grammar": {"type": "regex", "value": 3}}, "parameters.grammar.value", "str"),
    ("bad-regex", {"grammar": {"type": "regex", "value": "(("}}, "parameters.grammar.value", "invalid regex"),
    ("bad-schema", {"grammar": {"type": "json", "value": BAD_SCHEMA}}, "parameters.grammar.value",
     "invalid JSON schema"),
    ("schema-not-json", {"grammar": {"type": "json", "value": "{"}}, "parameters.grammar.value", "not valid JSON"),
    ("extra-key", {"grammar": {"type": "json", "value": SCHEMA, "x": 1}}, "parameters.grammar.x", "x"),
]


@pytest.mark.parametrize("case", TGI_REFUSED, ids=[c[0] for c in TGI_REFUSED])
def test_tgi_grammar_refused(case):
    _, parameters, param, text = case
    with pytest.raises(ValueError) as e:
        tgi(parameters)
    err = to_api_error(e.value)
    assert (err.status, err.param) == (400, param), err.message
    assert text.lower() in err.message.lower()
