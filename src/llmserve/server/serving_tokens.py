"""POST /tokenize and /detokenize (vLLM's), also served as /v1/tokenize and /v1/detokenize; GET /tokenizer_info."""

from __future__ import annotations

from llmserve.server.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                      TokenizerInfo, decode_json)
from llmserve.server.serving_common import ServingContext, render_chat
from llmserve.server.structured_fields import FieldError
from llmserve.server.tool_calls import template_tools


class TokenizerServer:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def tokenize(self, body: bytes) -> TokenizeResponse:
        ctx = self.ctx
        req: TokenizeRequest = decode_json(body, TokenizeRequest)
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise FieldError("prompt", "give exactly one of prompt or messages")
        if req.tools and req.messages is None:
            raise FieldError("tools", "tools are rendered with messages: give messages too")
        if req.prompt is not None:
            tokens = ctx.engine.encode(req.prompt, req.add_special_tokens)
        else:
            text = render_chat(ctx.engine.tokenizer, req.messages, req.add_generation_prompt,
                               template_tools(req.tools))
            tokens = ctx.engine.encode(text, add_special_tokens=False)
        token_strs = self.token_strs(tokens) if req.return_token_strs else None
        return TokenizeResponse(len(tokens), ctx.engine.model_info.max_model_len, tokens, token_strs)

    def token_strs(self, tokens: list[int]) -> list[str]:
        """Each token's vocabulary string (as vLLM: the tokenizer's own, e.g. 'Ġthe' for byte-level BPE)."""
        return [str(t) for t in self.ctx.engine.tokenizer.convert_ids_to_tokens(tokens)]

    def detokenize(self, body: bytes) -> DetokenizeResponse:
        req: DetokenizeRequest = decode_json(body, DetokenizeRequest)
        self.ctx.check_model(req.model)
        if not req.tokens:
            return DetokenizeResponse("")
        try:
            return DetokenizeResponse(self.ctx.engine.decode(req.tokens))
        except ValueError as e:  # an id outside the vocabulary
            raise FieldError("tokens", str(e)) from None

    def info(self) -> TokenizerInfo:
        """The tokenizer's class, special tokens and chat template; its length is the context the server allows."""
        tokenizer = self.ctx.engine.tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        return TokenizerInfo(type(tokenizer).__name__, len(tokenizer), self.ctx.engine.model_info.max_model_len,
                             tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token,
                             template)
