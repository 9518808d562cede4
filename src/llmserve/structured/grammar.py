"""StructuredOutputsParams -> xgrammar Grammar, and the front's syntax check (ValueError -> HTTP 400)."""

from __future__ import annotations

import json
import re

from llmserve.sampling_params import StructuredOutputsParams

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
            return _json_grammar(xgr, params.json, params.disable_any_whitespace)
        if kind == "json_object":
            return _json_grammar(xgr, '{"type": "object"}', params.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"invalid {_NAMES[kind]}: {native_message(e)}") from None


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice", "grammar": "grammar (EBNF)"}


def _json_grammar(xgr, schema: str, disable_any_whitespace: bool):
    if disable_any_whitespace:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE,
                                        strict_mode=True)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose strings are exactly `choices` (JSON escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def native_message(error: BaseException) -> str:
    """xgrammar's C++ error without its source location and check text."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return _NATIVE_PREFIX.sub("", lines[0] if lines else str(error)).strip()


def validate(params: StructuredOutputsParams) -> None:
    """Check the constraint's fields and syntax (no tokenizer needed); ValueError naming the problem."""
    params.validate()
    build_grammar(params)
