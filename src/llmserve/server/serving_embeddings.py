"""POST /v1/embeddings: each input pooled by the engine (--runner pooling) into one vector; `dimensions`
truncates a Matryoshka model's vectors (normalised again when the model normalises); float or base64."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from llmserve.engine.async_llm import TokensPrompt
from llmserve.pooling import PoolerConfig
from llmserve.server.protocol import encode_json, decode_json
from llmserve.server.protocol_embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from llmserve.server.serving_common import ServingContext, created_now, new_request_id
from llmserve.server.serving_completions import token_prompts
from llmserve.server.streams import until_disconnect
from llmserve.server.structured_fields import FieldError


def embedding_vector(pooled: bytes, pooler: PoolerConfig, dimensions: int | None) -> np.ndarray:
    """The engine's pooled vector [H] (float32 bytes), truncated to `dimensions` [D] and normalised again
    when the model normalises (a prefix of a unit vector is not one)."""
    vector = np.frombuffer(pooled, dtype="<f4")  # [H]
    if dimensions is None or dimensions >= len(vector):
        return vector
    vector = vector[:dimensions]  # [D]
    if pooler.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype("<f4")


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def check_embeddings(ctx: ServingContext, prompts: list[TokensPrompt], dimensions: int | None) -> None:
    """ValueError naming the field (`model`, `dimensions`, `input`) unless the engine may embed these prompts."""
    ctx.engine.check_runner(is_pooling=True)
    info = ctx.engine.model_info
    if dimensions is not None:
        try:
            info.pooler.check_dimensions(dimensions, info.hidden_size)
        except ValueError as e:
            raise FieldError("dimensions", str(e)) from None
    if not prompts:
        raise FieldError("input", "input must not be empty")
    try:
        for prompt in prompts:
            prompt.token_ids = ctx.engine.processor.tokenize(prompt.token_ids)  # ids in the vocabulary
            ctx.engine.processor.check_pooling_length(len(prompt.token_ids))
    except ValueError as e:
        raise FieldError("input", str(e)) from None


async def embed_all(ctx: ServingContext, prompts: list[TokensPrompt], request_id: str, dimensions: int | None,
                    priority: int = 0) -> list[np.ndarray]:
    """Each prompt's vector [D], pooled by the engine at once (cancelled together: each aborts its request)."""
    finals = await asyncio.gather(*(ctx.engine.embed(prompt, f"{request_id}-{i}", priority)
                                    for i, prompt in enumerate(prompts)))
    return [embedding_vector(final.pooled, ctx.engine.model_info.pooler, dimensions) for final in finals]


class EmbeddingServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request, body: bytes) -> Response:
        ctx = self.ctx
        req: EmbeddingRequest = decode_json(body, EmbeddingRequest)
        ctx.check_model(req.model)
        ctx.engine.check_runner(is_pooling=True)
        try:
            prompts = token_prompts(ctx, req.input, req.add_special_tokens, "input")
        except ValueError as e:
            raise FieldError("input", str(e)) from None
        check_embeddings(ctx, prompts, req.dimensions)
        ctx.admit(request.scope, len(prompts))
        request_id = new_request_id("embd")
        vectors = await until_disconnect(request, embed_all(ctx, prompts, request_id, req.dimensions), request_id)
        data = [Embedding(i, encode_vector(vector, req.encoding_format)) for i, vector in enumerate(vectors)]
        num_tokens = sum(len(prompt.token_ids) for prompt in prompts)
        usage = EmbeddingUsage(num_tokens, num_tokens)
        return Response(encode_json(EmbeddingResponse(request_id, created_now(), ctx.model_name, data, usage)),
                        media_type="application/json")
