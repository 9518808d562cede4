"""Merging JSON schemas (`allOf`, siblings of `anyOf`) and telling `oneOf` branches apart, for
schema_normalize: what a grammar can hold of two schemas at once, or a SchemaKeywordError naming why not."""

from __future__ import annotations

# Keywords that only annotate: they may sit beside anyOf/oneOf without moving into the branches.
ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "default", "examples", "deprecated",
                "readOnly", "writeOnly", "$defs", "anyOf", "oneOf", "$anchor", "format", "markdownDescription"}


class SchemaKeywordError(ValueError):
    """A keyword the grammar cannot enforce (or a merge it cannot make), with its JSON pointer."""

    def __init__(self, keyword: str, pointer: str, why: str = "cannot be enforced by the grammar") -> None:
        super().__init__(f"keyword {keyword!r} at {pointer or '/'} {why}")
        self.keyword = keyword
        self.pointer = pointer


def pointer(base: str, *parts) -> str:
    return base + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


class EmptyMerge(SchemaKeywordError):
    """A merge whose types do not intersect: no document validates."""


def merge(a, b, ptr: str):
    """Two schemas as one that takes exactly the documents both take; SchemaKeywordError when the grammar
    cannot express the merge (different values of one keyword other than those handled here)."""
    if b is True or b == {}:
        return a
    if a is True or a == {}:
        return b
    if a is False or b is False:
        raise EmptyMerge("allOf", ptr, "is unsatisfiable")
    out = dict(a)
    for key, value in b.items():
        if key not in out or out[key] == value:
            out[key] = value
        else:
            out[key] = _merge_keyword(key, out[key], value, ptr)
    return out


def _merge_keyword(key: str, x, y, ptr: str):
    if key == "type":
        both = [t for t in _types(x) if t in _types(y) or (t == "integer" and "number" in _types(y))]
        both += [t for t in _types(y) if t == "integer" and "number" in _types(x) and t not in both]
        if not both:
            raise EmptyMerge("allOf", ptr, "has subschemas whose types do not intersect")
        return both[0] if len(both) == 1 else both
    if key == "properties":
        return {**x, **{name: merge(x[name], sub, pointer(ptr, "properties", name)) if name in x else sub
                        for name, sub in y.items()}}
    if key == "required":
        return list(dict.fromkeys([*x, *y]))
    if key in ("minimum", "minLength", "minItems", "minProperties", "exclusiveMinimum"):
        return max(x, y)
    if key in ("maximum", "maxLength", "maxItems", "maxProperties", "exclusiveMaximum"):
        return min(x, y)
    if key in ANNOTATIONS - {"anyOf", "oneOf", "$defs"}:
        return x
    if key in ("additionalProperties", "items"):
        return merge(x, y, pointer(ptr, key))
    raise SchemaKeywordError("allOf", ptr, f"merges two different values of {key!r}: cannot be enforced")


def _types(t) -> list[str]:
    return list(t) if isinstance(t, list) else [t]


def is_exclusive(branches) -> bool:
    """Whether no document can validate against two branches (told by their types or constants, or by a
    required property whose constants differ: a discriminated union)."""
    if isinstance(branches, list) and _discriminated(branches):
        return True
    seen: list[set] = []
    for branch in branches:
        if not isinstance(branch, dict):
            return False
        if "const" in branch or "enum" in branch:
            values = [branch["const"]] if "const" in branch else branch["enum"]
            signature = {("value", repr(v)) for v in values}
        elif "type" in branch:
            signature = {("type", t) for t in _types(branch["type"])}
            if "number" in _types(branch["type"]):
                signature.add(("type", "integer"))
        else:
            return False
        if any(signature & other for other in seen):
            return False
        seen.append(signature)
    return True


def _discriminated(branches: list) -> bool:
    """Object branches that all require one property, each with its own constant values."""
    if not branches or not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    names = set.intersection(*(set(b.get("required", [])) for b in branches))
    for name in names:
        values = [_constants(b["properties"].get(name)) for b in branches]
        if all(v is not None for v in values) and len(set().union(*values)) == sum(map(len, values)):
            return True
    return False


def _constants(s) -> set | None:
    if isinstance(s, dict) and "const" in s:
        return {repr(s["const"])}
    if isinstance(s, dict) and isinstance(s.get("enum"), list):
        return {repr(v) for v in s["enum"]}
    return None
