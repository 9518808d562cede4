"""StructuredOutputsParams -> xgrammar Grammar, and the front's syntax check (ValueError -> HTTP 400)."""

from __future__ import annotations

import functools
import json
import re

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured.schema_normalize import GRAMMAR_FORMATS, SchemaKeywordError, normalize

# Whitespace between JSON tokens: at most this many characters a gap, so that a model cannot pad forever
# (pretty-printed JSON nested four deep still fits).
MAX_JSON_WHITESPACE = 16
# "[12:10:10] /project/cpp/file.cc:83: Check failed: (x) is false: message" -> "message"
_NATIVE_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?\S+\.(cc|h):\d+:\s*(Check failed:.*? is false:\s*)?")


def build_grammar(params: StructuredOutputsParams):
    """The constraint as an xgrammar Grammar; ValueError naming the problem when it is invalid."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            return _json_grammar(xgr, json_schema_for_grammar(params), params)
        if kind == "json_object":
            return _json_grammar(xgr, {"type": "object"}, params)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        if kind == "structural_tag":
            tag = _with_json_grammars(xgr, json.loads(params.structural_tag), params)
            return xgr.Grammar.from_structural_tag(json.dumps(tag))
        return xgr.Grammar.from_ebnf(params.grammar)
    except SchemaKeywordError as e:
        raise ValueError(f"JSON schema: {e}") from None
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"invalid {_NAMES[kind]}: {native_message(e)}") from None


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice", "grammar": "grammar (EBNF)", "structural_tag": "structural tag"}


def json_schema_for_grammar(params: StructuredOutputsParams) -> dict | bool:
    """The request's schema normalised (schema_normalize); SchemaKeywordError for the first keyword the
    grammar cannot enforce, unless the request asked for best effort."""
    return _enforceable(json.loads(params.json), params)


def _enforceable(schema: dict | bool, params: StructuredOutputsParams) -> dict | bool:
    normalized = normalize(schema, params.bound_numbers)
    if normalized.unenforced and not params.best_effort:
        raise normalized.unenforced[0]
    return normalized.schema


def _with_json_grammars(xgr, node, params: StructuredOutputsParams):
    """A structural tag whose JSON-schema parts are our JSON grammars (normalised schema, whitespace, strict
    mode and string bounds as for `json`), embedded as EBNF: xgrammar's own would differ from ours."""
    if isinstance(node, list):
        return [_with_json_grammars(xgr, item, params) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        if set(node) - {"type", "json_schema", "style"}:
            raise ValueError(f"a json_schema part takes only the schema, got {sorted(node)}")
        grammar = _json_grammar(xgr, _enforceable(node["json_schema"], params), params)
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: _with_json_grammars(xgr, value, params) for key, value in node.items()}


def unenforced_keywords(params: StructuredOutputsParams) -> list[str]:
    """What a best-effort JSON schema leaves unenforced, as "keyword at /pointer" (empty otherwise)."""
    if params.json is None:
        return []
    unenforced = normalize(json.loads(params.json), params.bound_numbers).unenforced
    return [f"{e.keyword} at {e.pointer or '/'}" for e in unenforced]


def _json_grammar(xgr, schema: dict | bool, params: StructuredOutputsParams):
    schema = json.dumps(without_unenforced_formats(schema))
    if params.disable_any_whitespace:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=params.strict)
    else:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE,
                                               strict_mode=params.strict)
    return _with_string_characters(xgr, grammar)


# A length-bounded string's character as xgrammar (0.2.9) writes it (`name_characters{min, max}`), as str(grammar)
# prints it: it lets raw control characters through (invalid JSON: xgrammar #800).
_XGRAMMAR_STRING_CHARACTER = r'(([^\"\\\r\n]))'
# Ours: what JSON takes unescaped (no control character, '"' or backslash), whole UTF-8 characters, no surrogates. A
# negated class, whose states' token masks xgrammar caches: a fill inside such a string costs a fraction of the same
# string's as a `pattern`, a regex walked at every fill (docs/benchmarks.md, H200 eighth run).
STRING_CHARACTER = r'(([^\0-\x1f\"\\\ud800-\udfff]))'
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "contains")


def _with_string_characters(xgr, grammar):
    """The grammar with every length-bounded string's character rule written as STRING_CHARACTER (through
    the EBNF text, as structural tags embed JSON grammars)."""
    text = str(grammar)
    if _XGRAMMAR_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_XGRAMMAR_STRING_CHARACTER, STRING_CHARACTER))


def without_unenforced_formats(schema):
    """The schema without the string `format`s the grammar cannot write (GRAMMAR_FORMATS are written): xgrammar
    ignores them, and would then let control characters through."""
    if isinstance(schema, list):
        return [without_unenforced_formats(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [without_unenforced_formats(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: without_unenforced_formats(s) for name, s in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = without_unenforced_formats(out[key])
    if out.get("format") not in GRAMMAR_FORMATS:
        out.pop("format", None)
    return out


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose strings are exactly `choices` (JSON escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def native_message(error: BaseException) -> str:
    """xgrammar's C++ error without its source location and check text."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return _NATIVE_PREFIX.sub("", lines[0] if lines else str(error)).strip()


def validate(params: StructuredOutputsParams) -> None:
    """Check the constraint's fields and syntax (no tokenizer needed); ValueError naming the problem.
    A constraint that passed is remembered (a JSON schema's check holds up the event loop)."""
    params.validate()
    _check_syntax(params.cache_key)


@functools.lru_cache(maxsize=256)  # only constraints that passed are kept (a raise is not cached)
def _check_syntax(key: tuple) -> None:
    kind, spec, disable_any_whitespace, strict, best_effort, bound_numbers = key
    options = {"disable_any_whitespace": disable_any_whitespace, "strict": strict, "best_effort": best_effort,
               "bound_numbers": bound_numbers}
    if kind == "json_object":
        params = StructuredOutputsParams(json_object=True, **options)
    else:
        value = list(spec) if kind == "choice" else spec
        params = StructuredOutputsParams(**{kind: value}, **options)
    build_grammar(params)
