"""Structured outputs end to end: the official `openai` client and huggingface_hub's InferenceClient against
a real server on a tiny random-weight model. Only the constraint can make such a model's output valid, so
every valid output here is the engine's doing; every schema bounds its strings, arrays and numbers so that
a constrained random model must finish. Bad constraints are 400s naming the problem, before any engine work.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient


MAX_TOKENS = 1200  # room for JSON with bounded whitespace; the context is 2048
SEED = 1234
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "seed": SEED}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def chat(text: str = "Answer in JSON.") -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- 400s: validation in the front (pass without the engine's constraint) ----------------------


def bad_request(call, *words: str) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    body = e.value.body
    assert e.value.status_code == 400 and body["type"] == "invalid_request_error"
    for word in words:
        assert word.lower() in body["message"].lower(), body["message"]
    return body


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


def test_invalid_schema_is_400(client):
    body = bad_request(lambda: client.chat.completions.create(
        model="tiny", messages=chat(), max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}}),
        "invalid JSON schema", "nope")
    assert body["param"] == "response_format.json_schema.schema"
    bad_request(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                                  extra_body={"guided_json": BAD_SCHEMA}), "guided_json", "nope")
    bad_request(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                                  extra_body={"structured_outputs": {"json": "{oops"}}),
                "structured_outputs.json", "not valid JSON")


def test_invalid_regex_and_grammar_are_400(client):
    body = bad_request(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                                         extra_body={"guided_regex": "[a-z"}), "invalid regex")
    assert body["param"] == "guided_regex"
    bad_request(lambda: client.chat.completions.create(model="tiny", messages=chat(), max_tokens=5,
                                                       extra_body={"structured_outputs": {"regex": "(a"}}),
                "structured_outputs.regex", "invalid regex")
    bad_request(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                                  extra_body={"guided_grammar": "root ::= ("}), "guided_grammar")


def test_name_and_schema_are_required(client):
    for spec, word in (({"schema": {"type": "object"}}, "name"), ({"name": "x"}, "schema"),
                       ({"name": "has space", "schema": {"type": "object"}}, "name")):
        bad_request(lambda: client.chat.completions.create(
            model="tiny", messages=chat(), max_tokens=5, response_format={"type": "json_schema", "json_schema": spec}),
            word)


def test_unknown_response_format_type_is_400(client):
    body = bad_request(lambda: client.chat.completions.create(model="tiny", messages=chat(), max_tokens=5,
                                                              response_format={"type": "xml"}), "xml")
    assert body["param"] == "response_format.type"


def test_two_constraints_are_400(client):
    json_schema = {"name": "x", "schema": {"type": "object"}}
    bad_request(lambda: client.chat.completions.create(
        model="tiny", messages=chat(), max_tokens=5, extra_body={"guided_regex": "a+"},
        response_format={"type": "json_schema", "json_schema": json_schema}),
        "only one", "response_format", "guided_regex")
    bad_request(lambda: client.completions.create(
        model="tiny", prompt="x", max_tokens=5,
        extra_body={"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}), "only one")
    bad_request(lambda: client.completions.create(
        model="tiny", prompt="x", max_tokens=5, extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
        "exactly one")


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_unsupported_fields_are_400_naming_them(client, extra, param):
    body = bad_request(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=extra),
                       param)
    assert body["param"] == param
    bad_request(lambda: client.chat.completions.create(model="tiny", messages=chat(), max_tokens=5, extra_body=extra),
                param)


@pytest.mark.parametrize("grammar, word", [({"type": "ebnf", "value": "root ::= x"}, "ebnf"),
                                           ({"type": "regex", "value": "(("}, "invalid regex"),
                                           ({"type": "json", "value": BAD_SCHEMA}, "invalid JSON schema")])
def test_tgi_bad_grammar_is_400(server, grammar, word):
    for path in ("/generate", "/generate_stream", "/"):
        response = httpx.post(server.url + path, json={"inputs": "x", "parameters": {"grammar": grammar}}, timeout=60)
        assert response.status_code == 400, response.text
        assert word.lower() in response.json()["error"]["message"].lower()


# ---- valid outputs (need the engine's constraint) ----------------------------------------------

S = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "nested-object": {
        "type": "object", "required": ["user", "active"], "additionalProperties": False,
        "properties": {"user": {"type": "object", "required": ["name", "age"], "additionalProperties": False,
                                "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
                       "active": {"type": "boolean"}}},
    "bounded-arrays": {
        "type": "object", "required": ["tags", "scores"], "additionalProperties": False,
        "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
                       "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                                  "minItems": 2, "maxItems": 4}}},
    "enum-const": {
        "type": "object", "required": ["color", "version", "unit"], "additionalProperties": False,
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "version": {"const": 2},
                       "unit": {"type": "string", "enum": ["cm", "in"]}}},
    "any-of": {
        "type": "object", "required": ["value"], "additionalProperties": False,
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, S, {"type": "null"}]}}},
    "one-of": {
        "type": "object", "required": ["shape"], "additionalProperties": False,
        "properties": {"shape": {"oneOf": [
            {"type": "object", "required": ["kind", "radius"], "additionalProperties": False,
             "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 9}}},
            {"type": "object", "required": ["kind", "side"], "additionalProperties": False,
             "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}}}]}}},
    "ref-defs": {
        "type": "object", "required": ["home", "work"], "additionalProperties": False,
        "$defs": {"address": {"type": "object", "required": ["city", "zip"], "additionalProperties": False,
                              "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}},
        "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}}},
    "patterns-and-optional": {
        "type": "object", "required": ["code"], "additionalProperties": False,
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "note": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 1,
                                                                              "maximum": 1000}}},
    "array-of-objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "required": ["id", "ok"], "additionalProperties": False,
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 50}, "ok": {"type": "boolean"}}}},
}
SCHEMA_IDS = list(SCHEMAS)


def check_json(text: str, finish_reason: str | None, schema: dict) -> None:
    assert finish_reason == "stop", f"finish_reason {finish_reason!r}: {text!r}"
    jsonschema.validate(json.loads(text), schema)


async def chat_text(aclient, stream: bool, **kwargs) -> tuple[str, str | None]:
    if not stream:
        out = await aclient.chat.completions.create(model="tiny", **kwargs)
        return out.choices[0].message.content, out.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await aclient.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


async def completion_text(aclient, stream: bool, **kwargs) -> tuple[str, str | None]:
    if not stream:
        out = await aclient.completions.create(model="tiny", **kwargs)
        return out.choices[0].text, out.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await aclient.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


def _variants(aclient, name: str, schema: dict) -> list:
    """The same schema through each field, greedy and sampled, streamed and not (run concurrently)."""
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    prompt = f"Give me a {name} as JSON: "
    return [chat_text(aclient, False, messages=chat(), max_tokens=MAX_TOKENS, response_format=response_format,
                      **GREEDY),
            chat_text(aclient, True, messages=chat(), max_tokens=MAX_TOKENS, response_format=response_format,
                      **SAMPLED),
            completion_text(aclient, True, prompt=prompt, max_tokens=MAX_TOKENS, **GREEDY,
                            extra_body={"structured_outputs": {"json": schema}}),
            completion_text(aclient, False, prompt=prompt, max_tokens=MAX_TOKENS, **SAMPLED,
                            extra_body={"guided_json": schema}),
            completion_text(aclient, False, prompt=prompt, max_tokens=MAX_TOKENS, **SAMPLED,
                            extra_body={"structured_outputs": {"json": json.dumps(schema),
                                                               "disable_any_whitespace": True}})]


@pytest.mark.parametrize("name", SCHEMA_IDS)
def test_json_schema_outputs_validate(aclient, name):
    schema = SCHEMAS[name]

    async def run():
        return await asyncio.gather(*_variants(aclient, name, schema))

    for text, finish in asyncio.run(run()):
        check_json(text, finish, schema)


def test_sampled_with_seed_is_reproducible(client):
    schema = SCHEMAS["bounded-arrays"]
    kwargs = dict(model="tiny", prompt="x", max_tokens=MAX_TOKENS, **SAMPLED, extra_body={"guided_json": schema})
    first, second = (client.completions.create(**kwargs).choices[0] for _ in range(2))
    check_json(first.text, first.finish_reason, schema)
    assert first.text == second.text


def test_openai_parse_with_a_pydantic_model(client):
    """The client's own structured-outputs helper: it sends a strict json_schema and parses the reply."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Point(BaseModel):
        label: str = Field(max_length=6)
        x: int = Field(ge=-9, le=9)
        kind: Literal["a", "b"]

    out = client.chat.completions.parse(model="tiny", messages=chat(), max_tokens=MAX_TOKENS,
                                        response_format=Point, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(out.choices[0].message.parsed, Point)


EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_regex_outputs_match(aclient, stream, sampling):
    async def run():
        return await asyncio.gather(
            completion_text(aclient, stream, prompt="email: ", max_tokens=100, **sampling,
                            extra_body={"guided_regex": EMAIL}),
            chat_text(aclient, stream, messages=chat("email?"), max_tokens=100, **sampling,
                      extra_body={"structured_outputs": {"regex": EMAIL}}))

    for text, finish in asyncio.run(run()):
        assert finish == "stop" and re.fullmatch(EMAIL, text), (text, finish)


CHOICES = ["red", "green", "blue", "dark blue"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_choice_outputs_are_one_of_them(aclient, stream, sampling):
    async def run():
        return await asyncio.gather(
            completion_text(aclient, stream, prompt="color: ", max_tokens=50, **sampling,
                            extra_body={"guided_choice": CHOICES}),
            chat_text(aclient, stream, messages=chat("color?"), max_tokens=50, **sampling,
                      extra_body={"structured_outputs": {"choice": CHOICES}}))

    for text, finish in asyncio.run(run()):
        assert finish == "stop" and text in CHOICES, (text, finish)


GRAMMAR = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [0-9] | [1-9] [0-9]'
GRAMMAR_RE = r"\(\d{1,2}(,\d{1,2}){0,3}\)"


def test_grammar_outputs_match(client):
    for extra in ({"guided_grammar": GRAMMAR}, {"structured_outputs": {"grammar": GRAMMAR}}):
        out = client.completions.create(model="tiny", prompt="tuple: ", max_tokens=100, **SAMPLED, extra_body=extra)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and re.fullmatch(GRAMMAR_RE, choice.text), choice


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_outputs(aclient, stream):
    """Any JSON object: a random model may nest or lengthen it past max_tokens, so only a finished one is parsed;
    without whitespace (structured_outputs) and with it (response_format)."""
    async def run():
        return await asyncio.gather(
            completion_text(aclient, stream, prompt="{}: ", max_tokens=MAX_TOKENS, **SAMPLED,
                            extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}),
            chat_text(aclient, stream, messages=chat(), max_tokens=MAX_TOKENS, **GREEDY,
                      response_format={"type": "json_object"}),
            chat_text(aclient, stream, messages=chat(), max_tokens=MAX_TOKENS, **GREEDY,
                      response_format={"type": "json_object"},
                      extra_body={"structured_outputs": {"disable_any_whitespace": True}}))

    for text, finish in asyncio.run(run()):
        assert finish in ("stop", "length")
        assert text.lstrip().startswith("{"), text
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


TGI_SCHEMA = SCHEMAS["enum-const"]


@pytest.mark.parametrize("do_sample", [False, True])
def test_tgi_grammar(server, do_sample):
    tgi = InferenceClient(model=server.url)
    sampling = {"do_sample": True, "seed": SEED} if do_sample else {}
    out = tgi.text_generation("json: ", max_new_tokens=MAX_TOKENS, details=True, **sampling,
                              grammar={"type": "json", "value": TGI_SCHEMA})
    assert out.details.finish_reason == "eos_token", out
    jsonschema.validate(json.loads(out.generated_text), TGI_SCHEMA)
    out = tgi.text_generation("email: ", max_new_tokens=100, details=True, **sampling,
                              grammar={"type": "regex", "value": EMAIL})
    assert out.details.finish_reason == "eos_token" and re.fullmatch(EMAIL, out.generated_text), out


def test_tgi_grammar_stream(server):
    tgi = InferenceClient(model=server.url)
    events = list(tgi.text_generation("json: ", max_new_tokens=MAX_TOKENS, stream=True, details=True,
                                      grammar={"type": "json", "value": json.dumps(TGI_SCHEMA)}))
    assert events[-1].details.finish_reason == "eos_token"
    jsonschema.validate(json.loads(events[-1].generated_text), TGI_SCHEMA)
    response = httpx.post(server.url + "/generate", timeout=300, json={
        "inputs": "email: ", "parameters": {"max_new_tokens": 100, "grammar": {"type": "regex", "value": EMAIL}}})
    assert response.status_code == 200 and re.fullmatch(EMAIL, response.json()["generated_text"]), response.text


# ---- keywords the grammar cannot enforce: refused by name, or best effort reported -------------------


UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 2, "uniqueItems": True}}, "required": ["tags"]}


def test_unenforceable_keyword_is_400_naming_it(client):
    body = bad_request(lambda: client.chat.completions.create(
        model="tiny", messages=chat(), max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": UNIQUE}}),
        "uniqueItems", "/properties/tags/uniqueItems")
    assert body["param"] == "response_format.json_schema.schema"


def test_best_effort_reports_unenforced_keywords_in_a_header(client):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=chat(), max_tokens=MAX_TOKENS, **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "u", "schema": UNIQUE}},
        extra_body={"structured_outputs": {"best_effort": True}})
    assert raw.headers["llmserve-unenforced-schema-keywords"] == "uniqueItems at /properties/tags/uniqueItems"
    assert set(json.loads(raw.parse().choices[0].message.content)) == {"tags"}


CORPUS = ["github_medium__o12077.json", "github_medium__o12562.json", "github_hard__o13151.json"]


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_schemas_through_the_server(client, name):
    from pathlib import Path

    schema = json.loads((Path(__file__).parents[1] / "data" / "schemas" / name).read_text())
    out = client.chat.completions.create(model="tiny", messages=chat(), max_tokens=MAX_TOKENS, **GREEDY,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "c", "schema": schema}})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), schema)


NUMBERS = {"type": "object", "required": ["i", "x"], "additionalProperties": False,
           "properties": {"i": {"type": "integer"}, "x": {"type": "number"}}}


def test_unbounded_numbers_cannot_run_away(client):
    """Greedy on random weights: integers and numbers the schema leaves unbounded end (their digits are
    bounded by the grammar: test_schema_normalize.test_numbers_bounded)."""
    out = client.chat.completions.create(model="tiny", messages=chat(), max_tokens=MAX_TOKENS, **GREEDY,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "n", "schema": NUMBERS}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), NUMBERS)
