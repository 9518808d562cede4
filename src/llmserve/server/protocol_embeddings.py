"""POST /v1/embeddings records (OpenAI's shape; `add_special_tokens` is vLLM's extra)."""

from __future__ import annotations

from typing import Literal

import msgspec

from llmserve.server.protocol import IgnoredFields, PositiveInt, PromptItem


class EmbeddingRequest(IgnoredFields, forbid_unknown_fields=True, kw_only=True):
    input: str | list[PromptItem]  # a string, strings, token ids, or lists of token ids
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: the float32 little-endian bytes
    dimensions: PositiveInt | None = None  # Matryoshka models only: the first this many, normalised again
    add_special_tokens: bool = True


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"
