"""OpenAPI for routes that decode their bodies with msgspec (served at /openapi.json, /docs).

FastAPI describes pydantic models only; our routes read the raw body and decode it into msgspec
records. So each route names its records (`body`, `responses`) and `DocumentedAPI.openapi()` adds their
JSON Schemas, which msgspec generates from the very types the server decodes with, to the document's
components: the schema cannot drift from what the server accepts. What a schema cannot say (a value's
range that depends on the model, a field refused unless it has its neutral value) is a 400 at run time.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI

from llmserve.http.errors import ErrorBody

REF_TEMPLATE = "#/components/schemas/{name}"
SSE = "text/event-stream"


def schema_ref(cls: type) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(name=cls.__name__)}


class DocumentedAPI(FastAPI):
    """A FastAPI app whose OpenAPI document also describes the msgspec records its routes name."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.schema_types: list[type] = [ErrorBody]

    def _named(self, cls: type) -> dict[str, str]:
        if cls not in self.schema_types:
            self.schema_types.append(cls)
        return schema_ref(cls)

    def body(self, cls: type) -> dict[str, Any]:
        """`openapi_extra` for a route whose JSON body decodes into `cls`."""
        content = {"application/json": {"schema": self._named(cls)}}
        return {"requestBody": {"required": True, "content": content}}

    def responses(self, json: type | dict | None = None, *, chunk: type | None = None,
                  chunk_error: type = ErrorBody, text: str | None = None,
                  description: str = "Success") -> dict[int | str, Any]:
        """`responses` for a route: its 200 (a JSON record or schema, an SSE stream of `chunk` records that
        may end with a `chunk_error`, or text of a media type) and, for any other status, an OpenAI-shaped
        error."""
        content: dict[str, Any] = {}
        if json is not None:
            content["application/json"] = {"schema": json if isinstance(json, dict) else self._named(json)}
        if chunk is not None:
            content[SSE] = {"schema": self._event(chunk, chunk_error)}
        if text is not None:
            content[text] = {"schema": {"type": "string"}}
        success = {"description": description, **({"content": content} if content else {})}
        error = {"description": "An error (OpenAI's shape)",
                 "content": {"application/json": {"schema": self._named(ErrorBody)}}}
        return {200: success, "default": error}

    def _event(self, chunk: type, chunk_error: type) -> dict[str, Any]:
        """One server-sent event (OpenAPI 3.1: an SSE media type's schema describes each event)."""
        payload = {"anyOf": [self._named(chunk), self._named(chunk_error)]}
        json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
        data = {"anyOf": [json_data, {"const": "[DONE]"}]}  # OpenAI's streams end with `data: [DONE]`
        return {"type": "object", "properties": {"data": data, "event": {"type": "string"}}, "required": ["data"],
                "description": f"`data`: a {chunk.__name__} as JSON, or a {chunk_error.__name__} when the "
                               f"request fails once streaming (OpenAI's streams end with `data: [DONE]`)"}

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            document = super().openapi()
            _, components = msgspec.json.schema_components(self.schema_types, ref_template=REF_TEMPLATE)
            document.setdefault("components", {}).setdefault("schemas", {}).update(components)
        return self.openapi_schema
