"""POST /v1/embeddings: each input pooled by the engine (--runner pooling) into one vector; `dimensions`
truncates a Matryoshka model's vectors (normalised again when the model normalises); float or base64."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from llmserve.outputs import RequestOutput
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


class EmbeddingServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request, body: bytes) -> Response:
        ctx = self.ctx
        req: EmbeddingRequest = decode_json(body, EmbeddingRequest)
        ctx.check_model(req.model)
        ctx.engine.check_runner(is_pooling=True)
        info = ctx.engine.model_info
        if req.dimensions is not None:
            try:
                info.pooler.check_dimensions(req.dimensions, info.hidden_size)
            except ValueError as e:
                raise FieldError("dimensions", str(e)) from None
        try:
            prompts = token_prompts(ctx, req.input, req.add_special_tokens, "input")
            for prompt in prompts:
                prompt.token_ids = ctx.engine.processor.tokenize(prompt.token_ids)  # ids in the vocabulary
                ctx.engine.processor.check_pooling_length(len(prompt.token_ids))
        except ValueError as e:
            raise FieldError("input", str(e)) from None
        ctx.admit(request.scope, len(prompts))
        request_id = new_request_id("embd")
        work = asyncio.gather(*(ctx.engine.embed(p, f"{request_id}-{i}") for i, p in enumerate(prompts)))
        finals = await until_disconnect(request, work, request_id)
        return Response(encode_json(self._response(req, request_id, finals)), media_type="application/json")

    def _response(self, req: EmbeddingRequest, request_id: str, finals: list[RequestOutput]) -> EmbeddingResponse:
        pooler = self.ctx.engine.model_info.pooler
        data = [Embedding(i, encode_vector(embedding_vector(final.pooled, pooler, req.dimensions),
                                           req.encoding_format))
                for i, final in enumerate(finals)]
        num_tokens = sum(len(final.prompt_token_ids) for final in finals)
        return EmbeddingResponse(request_id, created_now(), self.ctx.model_name, data,
                                 EmbeddingUsage(num_tokens, num_tokens))
