"""JSON schemas rewritten into what xgrammar enforces, and the keywords it would not enforce.

xgrammar reads 2020-12 and ignores what it does not know, so a schema is first rewritten: older drafts'
forms (`definitions`, tuple `items`, `additionalItems`, `dependencies`, boolean `exclusiveMinimum`) become
2020-12's, `allOf` is merged into its parent, keywords beside `anyOf`/`oneOf` move into every branch,
`type` lists become one branch per type (so each type's keywords apply), control characters in patterns
are escaped, and numbers get bounds (so a model cannot write digits forever). What is left that the grammar
cannot enforce is listed by keyword and JSON pointer: the caller refuses it or reports it (best effort).
No library does this rewrite for a grammar (they validate documents), so it is ours.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from llmserve.structured.schema_merge import (ANNOTATIONS, EmptyMerge, SchemaKeywordError, is_exclusive, merge,
                                              pointer)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_EXACT_NUMBER = 2**53 - 1  # beyond, a double no longer holds every integer; xgrammar then bounds fractions

# Keywords xgrammar does not enforce (tested: documents breaking them get through).
_UNENFORCED = ("not", "if", "then", "else", "dependentSchemas", "unevaluatedItems", "minContains",
               "maxContains", "$dynamicRef", "$recursiveRef")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "patternProperties", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems")
_TYPE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "integer": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems", "contains"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties", "propertyNames", "dependentRequired"),
}
# String formats xgrammar writes a grammar for (json_schema_converter.cc); it ignores the others.
GRAMMAR_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                   "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
_CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f", "\v": "\\v"}


@dataclass
class Normalized:
    """The rewritten schema and the keywords it still holds that the grammar would not enforce."""

    schema: dict | bool
    unenforced: list[SchemaKeywordError] = field(default_factory=list)


def normalize(schema: dict | bool, bound_numbers: bool = True) -> Normalized:
    """`schema` rewritten for xgrammar (a new object), with its unenforced keywords."""
    schema = _drafts_everywhere(copy.deepcopy(schema))
    walker = _Walker(schema if isinstance(schema, dict) else {}, bound_numbers)
    out = walker.node(copy.deepcopy(schema), "")
    return Normalized(out, walker.unenforced)


def escape_pattern(pattern: str) -> str:
    """Control characters written literally in a pattern as regex escapes (the grammar's lexer refuses
    them; the regex means the same)."""
    return "".join(_CONTROL_ESCAPES.get(c, f"\\x{ord(c):02x}" if ord(c) < 0x20 else c) for c in pattern)


def _drafts_everywhere(s):
    """_older_drafts applied to every subschema (so `$ref`s resolve in 2020-12 terms), in place."""
    if not isinstance(s, dict):
        return s
    _older_drafts(s)
    for key in _SCHEMA_LISTS:
        if isinstance(s.get(key), list):
            s[key] = [_drafts_everywhere(sub) for sub in s[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            s[key] = {name: _drafts_everywhere(sub) for name, sub in s[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(s.get(key), dict):
            s[key] = _drafts_everywhere(s[key])
    for key, value in s.items():  # subschemas under keys of no draft (xgrammar follows $refs into them)
        if isinstance(value, dict) and key not in _KNOWN_KEYS:
            _drafts_everywhere(value)
    return s


_KNOWN_KEYS = {*_SCHEMA_LISTS, *_SCHEMA_MAPS, *_SCHEMA_ONE, "enum", "const", "default", "examples", "definitions"}


class _Walker:
    def __init__(self, root: dict, bound_numbers: bool) -> None:
        self.root = root  # older drafts' forms rewritten, not normalised further
        self.bound_numbers = bound_numbers
        self.unenforced: list[SchemaKeywordError] = []
        self.resolving: set[str] = set()

    def node(self, s, ptr: str):
        if not isinstance(s, dict):
            return s
        _older_drafts(s)
        if isinstance(s.get("pattern"), str):
            s["pattern"] = escape_pattern(s["pattern"])
        self._children(s, ptr)
        if isinstance(s.get("$ref"), str) and set(s) - ANNOTATIONS - {"$ref"}:
            s = self.resolve(s)  # xgrammar reads a $ref alone: its siblings go into the target
            if "$ref" in s and set(s) - ANNOTATIONS - {"$ref"}:
                self.unenforced.append(SchemaKeywordError("$ref", pointer(ptr, "$ref"), "has sibling keywords "
                                                          "beside a recursive reference: they are not enforced"))
        _declare_required(s, ptr)
        _typed_enum(s, ptr)
        if "allOf" in s:
            s = self._merge_all_of(s, ptr)
        s = self._split_types(s, ptr)
        if "anyOf" in s or "oneOf" in s:
            s = self._distribute(s, ptr)
        if self.bound_numbers:
            _bound_number(s)
        self._check(s, ptr)
        return s

    def _children(self, s: dict, ptr: str) -> None:
        for key in _SCHEMA_LISTS:
            if isinstance(s.get(key), list):
                s[key] = [self.node(sub, pointer(ptr, key, i)) for i, sub in enumerate(s[key])]
        for key in _SCHEMA_MAPS:
            if isinstance(s.get(key), dict):
                s[key] = {name: self.node(sub, pointer(ptr, key, name)) for name, sub in s[key].items()}
        for key in _SCHEMA_ONE:
            if isinstance(s.get(key), dict):
                s[key] = self.node(s[key], pointer(ptr, key))

    def _check(self, s: dict, ptr: str) -> None:
        for key in _UNENFORCED:
            if key in s:
                self.unenforced.append(SchemaKeywordError(key, pointer(ptr, key)))
        if s.get("uniqueItems") is True and not _at_most_one_item(s):
            self.unenforced.append(SchemaKeywordError("uniqueItems", pointer(ptr, "uniqueItems")))
        for bound in ("minLength", "maxLength"):
            if bound in s and ("pattern" in s or s.get("format") in GRAMMAR_FORMATS):
                self.unenforced.append(SchemaKeywordError(bound, pointer(ptr, bound), "beside a pattern or "
                                                          "format cannot be enforced by the grammar"))
        if "unevaluatedProperties" in s:
            self.unenforced.append(SchemaKeywordError("unevaluatedProperties", pointer(ptr, "unevaluatedProperties")))
        ref = s.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            self.unenforced.append(SchemaKeywordError("$ref", pointer(ptr, "$ref"), "is not local (only #... is)"))
        if "oneOf" in s and not is_exclusive(s["oneOf"]):
            self.unenforced.append(SchemaKeywordError("oneOf", pointer(ptr, "oneOf"),
                                                      "has branches that may overlap: exactly-one is not enforced"))

    def resolve(self, s):
        """A local `$ref` replaced by its target (one level; the target is already normalised)."""
        if not isinstance(s, dict) or not isinstance(s.get("$ref"), str) or not s["$ref"].startswith("#"):
            return s
        target = self.root
        for part in filter(None, s["$ref"][1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if part == "definitions":
                part = "$defs"
            target = target.get(part) if isinstance(target, dict) else None
        ref = s["$ref"]
        if not isinstance(target, dict) or target is self.root or ref in self.resolving:
            return s  # recursive or unresolvable: left to xgrammar
        self.resolving.add(ref)
        try:
            target = self.node(copy.deepcopy(target), ref[1:])
        finally:
            self.resolving.discard(ref)
        if "$ref" in target:
            return s
        rest = {k: v for k, v in s.items() if k != "$ref"}
        return merge(target, rest, "") if rest else target

    def _merge_all_of(self, s: dict, ptr: str) -> dict:
        members = s.pop("allOf")
        out = s
        for i, member in enumerate(members):
            member = self.resolve(member)
            if isinstance(member, dict) and ("$ref" in member or "allOf" in member):
                raise SchemaKeywordError("allOf", pointer(ptr, "allOf", i), "holds a recursive $ref: cannot be merged")
            out = merge(out, member, pointer(ptr, "allOf", i))
        self._children(out, ptr)  # merged subschemas may hold a $ref beside other keywords now
        return out

    def _split_types(self, s: dict, ptr: str) -> dict:
        types = s.get("type")
        if not isinstance(types, list) or len(types) < 2 or "anyOf" in s or "oneOf" in s:
            return s
        own = {t: {k: s[k] for k in _TYPE_KEYWORDS.get(t, ()) if k in s} for t in types}
        rest = {k: v for k, v in s.items() if k != "type" and not any(k in _TYPE_KEYWORDS[t] for t in _TYPE_KEYWORDS)}
        rest["anyOf"] = [{"type": t, **own[t]} for t in types]
        for branch in rest["anyOf"]:
            if self.bound_numbers:
                _bound_number(branch)
        return rest

    def _distribute(self, s: dict, ptr: str) -> dict:
        """Keywords beside anyOf/oneOf copied into each branch (xgrammar reads only the branches)."""
        key = "anyOf" if "anyOf" in s else "oneOf"
        siblings = {k: v for k, v in s.items() if k not in ANNOTATIONS}
        if not siblings or not isinstance(s[key], list):
            return s
        if "anyOf" in s and "oneOf" in s:
            raise SchemaKeywordError("oneOf", pointer(ptr, "oneOf"), "beside anyOf cannot be merged")
        branches = []
        for i, branch in enumerate(s[key]):
            try:
                merged = merge(copy.deepcopy(siblings), self.resolve(branch), pointer(ptr, key, i))
                branches.append(self.node(merged, pointer(ptr, key, i)))
            except EmptyMerge:
                continue  # this branch cannot hold beside its siblings: no document takes it
        if not branches:
            raise SchemaKeywordError(key, pointer(ptr, key), "has no branch compatible with its siblings")
        out = {k: v for k, v in s.items() if k in ANNOTATIONS}
        out[key] = branches
        return out


def _older_drafts(s: dict) -> None:
    """Draft-04/06/07 forms rewritten as 2020-12's, in place."""
    if isinstance(s.get("definitions"), dict):
        s["$defs"] = {**s.pop("definitions"), **s.get("$defs", {})}
    if isinstance(s.get("$ref"), str):
        s["$ref"] = s["$ref"].replace("/definitions/", "/$defs/")
    for bound, flag in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(s.get(flag), bool):
            if s.pop(flag) and bound in s:
                s[flag] = s.pop(bound)
    if isinstance(s.get("items"), list):
        s["prefixItems"] = s.pop("items")
        if "additionalItems" in s:
            s["items"] = s.pop("additionalItems")
    s.pop("additionalItems", None)  # without tuple items it applies to nothing
    dependencies = s.pop("dependencies", None)
    if isinstance(dependencies, dict):
        for name, value in dependencies.items():
            kind = "dependentRequired" if isinstance(value, list) else "dependentSchemas"
            s.setdefault(kind, {})[name] = value


def _at_most_one_item(s: dict) -> bool:
    """An array of at most one item: `uniqueItems` holds whatever it is."""
    max_items = s.get("maxItems")
    return isinstance(max_items, int) and max_items <= 1 or s.get("items") is False and not s.get("prefixItems")


def _declare_required(s: dict, ptr: str) -> None:
    """Required names missing from `properties` declared there with the schema their value must follow
    (xgrammar leaves them out otherwise)."""
    required, properties = s.get("required"), s.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    if missing:
        s["properties"] = {**properties, **{name: _value_schema(s, name, ptr) for name in missing}}


def _value_schema(s: dict, name: str, ptr: str):
    """The schema a property `name` that `properties` does not list must follow."""
    for pattern, sub in (s.get("patternProperties") or {}).items():
        try:
            if re.search(pattern, name):
                return sub
        except re.error:
            raise SchemaKeywordError("patternProperties", pointer(ptr, "patternProperties", pattern),
                                     "is not a regex this server can match a required name against") from None
    extra = s.get("additionalProperties", {})
    if extra is False:
        raise SchemaKeywordError("required", pointer(ptr, "required"), f"names {name!r}, which "
                                 "additionalProperties: false forbids (no document is valid)")
    return extra if isinstance(extra, dict) else {}


def _typed_enum(s: dict, ptr: str) -> None:
    """`enum` values of another type than `type` dropped (xgrammar would write them); none left: refused."""
    kind, values = s.get("type"), s.get("enum")
    if not isinstance(kind, str) or not isinstance(values, list) or kind not in _JSON_TYPES:
        return
    kept = [v for v in values if _JSON_TYPES[kind](v)]
    if not kept:
        raise SchemaKeywordError("enum", pointer(ptr, "enum"), f"holds no value of type {kind!r} (no document is valid)")
    s["enum"] = kept


_JSON_TYPES = {
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
}


def _bound_number(s: dict) -> None:
    """An integer between int64's bounds, a number within +-(2**53 - 1) (xgrammar then bounds its fraction
    and writes no exponent), unless the schema bounds it already or lists its values."""
    kind = s.get("type")
    if kind not in ("integer", "number") or "enum" in s or "const" in s:
        return
    low, high = (INT64_MIN, INT64_MAX) if kind == "integer" else (-MAX_EXACT_NUMBER, MAX_EXACT_NUMBER)
    if "minimum" not in s and "exclusiveMinimum" not in s:
        s["minimum"] = low
    if "maximum" not in s and "exclusiveMaximum" not in s:
        s["maximum"] = high
