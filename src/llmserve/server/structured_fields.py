"""Request fields that constrain the output -> one StructuredOutputsParams (or None), checked up front.

Accepted forms, on /v1/completions and /v1/chat/completions alike:
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs` object (json, regex, choice, grammar, json_object, disable_any_whitespace);
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (and
  `guided_decoding_backend` "xgrammar"/"auto");
and TGI's `grammar` parameter (`{"type": "json" | "regex", "value": ...}`) on /generate.

At most one constraint a request; `structured_outputs.disable_any_whitespace` may go with a JSON constraint
given by another field (as vLLM merges them). Every problem is a FieldError (a ValueError -> 400) whose
message and `param` name the field; syntax is checked by llmserve.structured.grammar.validate (xgrammar).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured.grammar import unenforced_keywords, validate

if TYPE_CHECKING:
    from llmserve.server.protocol import SamplingFields

ACCEPTED_BACKENDS = ("xgrammar", "auto")
_GUIDED_KINDS = {"guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_NOT_SUPPORTED = "not supported: only the default"
_NO_WHITESPACE = "structured_outputs.disable_any_whitespace"
_BEST_EFFORT = "structured_outputs.best_effort"
_BOUND_NUMBERS = "structured_outputs.bound_numbers"
_CLOSED = "structured_outputs.disable_additional_properties"
logger = logging.getLogger(__name__)
UNENFORCED_HEADER = "llmserve-unenforced-schema-keywords"
# What this request's best-effort schema leaves unenforced ("keyword at /pointer"), for the response header.
unenforced_in_request: ContextVar[tuple[str, ...]] = ContextVar("unenforced_in_request", default=())


class FieldError(ValueError):
    """A user error naming the request field at fault (`param`, as in OpenAI's error shape)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# ---- records (their JSON Schemas are in /openapi.json) ------------------------------------------

SchemaName = Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]+$", min_length=1, max_length=64)]
JsonSchema = dict[str, Any] | str  # an object, or its JSON text


class JsonSchemaSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's `response_format.json_schema`. `name` is required (as OpenAI and vLLM do), `schema` too
    (a format with no schema constrains nothing); `strict` false: objects may hold properties the schema
    does not name unless it forbids them (true or absent: only the named ones); `description` is the
    client's note, not sent to the model."""

    name: SchemaName
    schema: dict[str, Any]
    strict: bool | None = None
    description: str | None = None


class TextFormat(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """Plain text: no constraint."""


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    """Any JSON object."""


class JsonSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    """JSON that validates against `json_schema.schema`."""

    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputsRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object (or none, to
    pass `disable_any_whitespace`, `best_effort` or `disable_additional_properties` to another field's JSON
    constraint; the last is strict mode). `best_effort`: schema
    keywords the grammar cannot enforce are left unenforced (logged) instead of refused. `bound_numbers` (default
    true): a JSON schema's unbounded integers stay within int64 and its numbers within +-(2**53 - 1), so digits
    cannot run to max_tokens; false keeps the schema's own bounds only. vLLM's other options are refused
    unless they have their default value (`disable_fallback` is accepted either way: there is no fallback)."""

    json: JsonSchema | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    best_effort: bool = False
    bound_numbers: bool = True
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Annotated[str | None, Meta(description=_NOT_SUPPORTED)] = None
    structural_tag: Annotated[str | None, Meta(description=_NOT_SUPPORTED)] = None


class TGIJsonGrammar(msgspec.Struct, tag_field="type", tag="json", forbid_unknown_fields=True):
    """TGI's JSON grammar: `value` is a JSON schema (object or JSON text)."""

    value: JsonSchema


class TGIJsonObjectGrammar(TGIJsonGrammar, tag="json_object"):
    """TGI's alias of `json`."""


class TGIRegexGrammar(msgspec.Struct, tag_field="type", tag="regex", forbid_unknown_fields=True):
    value: str


TGIGrammar = TGIJsonGrammar | TGIJsonObjectGrammar | TGIRegexGrammar


# ---- fields -> StructuredOutputsParams ----------------------------------------------------------


@contextmanager
def _field(name: str) -> Iterator[None]:
    """A ValueError raised inside becomes a FieldError naming `name`."""
    try:
        yield
    except FieldError:
        raise
    except ValueError as e:
        raise FieldError(name, f"{name}: {e}") from None


def _schema(name: str, schema: JsonSchema) -> StructuredOutputsParams:
    with _field(name):
        return StructuredOutputsParams.from_json_schema(schema)


def _response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutputsParams(json_object=True)
    if isinstance(fmt, JsonSchemaFormat):
        params = _schema("response_format.json_schema.schema", fmt.json_schema.schema)
        return msgspec.structs.replace(params, strict=fmt.json_schema.strict is not False)
    return None  # absent, or text


def _check_vllm_options(so: StructuredOutputsRequest) -> None:
    refused = {"whitespace_pattern": so.whitespace_pattern is not None,
               "structural_tag": so.structural_tag is not None}
    for name, is_set in refused.items():
        if is_set:
            raise FieldError(f"structured_outputs.{name}", f"structured_outputs.{name} is not supported")


def _structured_outputs(so: StructuredOutputsRequest | None) -> StructuredOutputsParams | None:
    """The object's constraint (None when it only carries options)."""
    if so is None:
        return None
    _check_vllm_options(so)
    json_text = None if so.json is None else _schema("structured_outputs.json", so.json).json
    params = StructuredOutputsParams(json=json_text, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                     json_object=bool(so.json_object))
    return params if params.kinds() else None


def _guided(req: SamplingFields) -> list[tuple[str, StructuredOutputsParams | None]]:
    """vLLM's older guided_* fields, each its own constraint."""
    if req.guided_whitespace_pattern is not None:
        raise FieldError("guided_whitespace_pattern", "guided_whitespace_pattern is not supported")
    backend = req.guided_decoding_backend
    if backend is not None and backend not in ACCEPTED_BACKENDS:
        raise FieldError("guided_decoding_backend", f"guided_decoding_backend {backend!r} is not supported "
                                                    f"(this server uses xgrammar: {' or '.join(ACCEPTED_BACKENDS)})")
    candidates = [("guided_json", None if req.guided_json is None else _schema("guided_json", req.guided_json))]
    for name, kind in _GUIDED_KINDS.items():
        value = getattr(req, name)
        candidates.append((name, None if value is None else StructuredOutputsParams(**{kind: value})))
    return candidates


def _one(candidates: list[tuple[str, StructuredOutputsParams | None]]) -> tuple[str, StructuredOutputsParams] | None:
    found = [(name, params) for name, params in candidates if params is not None]
    if len(found) > 1:
        names = [name for name, _ in found]
        raise FieldError(names[1], f"only one output constraint per request is supported; got {', '.join(names)}")
    return found[0] if found else None


def _field_of(name: str, params: StructuredOutputsParams) -> str:
    """The field a constraint's syntax error names: the schema's, or the kind's within structured_outputs."""
    kinds = params.kinds()
    if name == "response_format" and kinds == ["json"]:
        return "response_format.json_schema.schema"
    if name == "structured_outputs" and len(kinds) == 1 and kinds[0] != "json_object":
        return f"structured_outputs.{kinds[0]}"
    return name


def _checked(name: str, params: StructuredOutputsParams) -> StructuredOutputsParams:
    with _field(name):
        validate(params)
    return params


def _without_whitespace(found: tuple[str, StructuredOutputsParams] | None) -> tuple[str, StructuredOutputsParams]:
    """structured_outputs.disable_any_whitespace applied to the request's JSON constraint, whichever field
    gave it (as vLLM merges them)."""
    kinds = found[1].kinds() if found is not None else []
    if not set(kinds) & {"json", "json_object"}:
        raise FieldError(_NO_WHITESPACE, f"{_NO_WHITESPACE} applies to a JSON constraint "
                                         f"(this request has {'/'.join(kinds) or 'none'})")
    name, params = found
    return name, msgspec.structs.replace(params, disable_any_whitespace=True)


def request_structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint an OpenAI request (completions or chat) asks for, checked; None when it asks none."""
    so = req.structured_outputs
    found = _one([("response_format", _response_format(req.response_format)),
                  ("structured_outputs", _structured_outputs(so)), *_guided(req)])
    if so is not None and so.disable_any_whitespace:
        found = _without_whitespace(found)
    if so is not None and not so.bound_numbers:
        found = _unbounded_numbers(found)
    if so is not None and so.best_effort:
        found = _best_effort(found)
    if so is not None and so.disable_additional_properties:
        found = _closed_objects(found)
    if found is None:
        return None
    name, params = found
    return _checked(_field_of(name, params), params)


def _closed_objects(found: tuple[str, StructuredOutputsParams] | None) -> tuple[str, StructuredOutputsParams]:
    """structured_outputs.disable_additional_properties: objects hold only the properties their schema names
    unless it allows more, which is the strict mode (it wins over `strict: false`)."""
    if found is None or found[1].json is None:
        raise FieldError(_CLOSED, f"{_CLOSED} applies to a JSON schema constraint")
    return found[0], msgspec.structs.replace(found[1], strict=True)


def _unbounded_numbers(found: tuple[str, StructuredOutputsParams] | None) -> tuple[str, StructuredOutputsParams]:
    """structured_outputs.bound_numbers false: the JSON schema's numbers keep only the bounds it gives them."""
    if found is None or found[1].json is None:
        raise FieldError(_BOUND_NUMBERS, f"{_BOUND_NUMBERS} applies to a JSON schema constraint")
    return found[0], msgspec.structs.replace(found[1], bound_numbers=False)


def _best_effort(found: tuple[str, StructuredOutputsParams] | None) -> tuple[str, StructuredOutputsParams]:
    """structured_outputs.best_effort applied to the request's JSON schema; what it leaves unenforced is
    logged."""
    if found is None or found[1].json is None:
        raise FieldError(_BEST_EFFORT, f"{_BEST_EFFORT} applies to a JSON schema constraint")
    name, params = found
    params = msgspec.structs.replace(params, best_effort=True)
    unenforced = unenforced_keywords(params)
    if unenforced:
        logger.warning("best-effort JSON schema: not enforced: %s", "; ".join(unenforced))
        unenforced_in_request.set(tuple(unenforced))
    return name, params


def tgi_structured_outputs(grammar: TGIGrammar | None) -> StructuredOutputsParams | None:
    """TGI's `grammar` parameter, checked; None when absent."""
    if grammar is None:
        return None
    name = "parameters.grammar.value"
    if isinstance(grammar, TGIRegexGrammar):
        return _checked(name, StructuredOutputsParams(regex=grammar.value))
    return _checked(name, _schema(name, grammar.value))
