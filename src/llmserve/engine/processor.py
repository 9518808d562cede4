"""The front's input side: validate and tokenize a prompt, resolve sampling defaults, fan out n > 1."""

from __future__ import annotations

import time

from llmserve.lora_request import LoRARequest
from llmserve.messages import EngineCoreRequest
from llmserve.sampling_params import ParamError, SamplingParams
from llmserve.structured.grammar import validate as validate_constraint

# generation_config.json keys that become SamplingParams defaults.
_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


class Processor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: list[int],
                 generation_defaults: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.generation_defaults = {k: v for k, v in (generation_defaults or {}).items()
                                    if k in _GENERATION_DEFAULT_KEYS and v is not None}

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults, then `overrides` on top."""
        return SamplingParams(**{**self.generation_defaults, **overrides})

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ParamError("prompt", "prompt must not be empty")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        token_ids = list(prompt)
        if not token_ids:
            raise ParamError("prompt", "prompt must not be empty")
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
                raise ParamError("prompt", f"prompt token id {token_id!r} is outside the vocabulary "
                                           f"[0, {self.vocab_size})")
        return token_ids

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise ParamError("prompt", f"This model's maximum context length is {self.max_model_len} tokens. "
                                       f"However, your prompt has {num_prompt_tokens} tokens, leaving no room for the "
                                       "completion.")
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ParamError("max_tokens", f"This model's maximum context length is {self.max_model_len} tokens. "
                                           f"However, you requested {num_prompt_tokens + params.max_tokens} tokens "
                                           f"({num_prompt_tokens} in the prompt, {params.max_tokens} in the "
                                           "completion). Reduce the prompt or max_tokens.")
        if params.min_tokens > self.max_model_len - num_prompt_tokens:
            raise ParamError("min_tokens", f"min_tokens={params.min_tokens} does not fit the context after "
                                           f"{num_prompt_tokens} prompt tokens (max_model_len {self.max_model_len})")

    def check_pooling_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens > self.max_model_len:
            raise ParamError("input", f"This model's maximum context length is {self.max_model_len} tokens. "
                                      f"However, your input has {num_prompt_tokens} tokens. Shorten the input.")

    def process_pooling(self, request_id: str, prompt_token_ids: list[int], priority: int = 0) -> EngineCoreRequest:
        """A pooling request (--runner pooling): the prompt only, which may fill the whole context."""
        self.check_pooling_length(len(prompt_token_ids))
        return EngineCoreRequest(request_id, prompt_token_ids, pooling_params(), [], time.time(), priority)

    def process(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                arrival_time: float | None = None, is_final_only: bool = False,
                lora: LoRARequest | None = None) -> list[EngineCoreRequest]:
        """Validated engine requests: one per sequence (n of them, ids from child_request_id).
        is_final_only: the front reads only finished sequences (EngineCoreRequest.is_final_only)."""
        params.validate()
        params.validate_for_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            validate_constraint(params.structured_outputs)  # a bad schema is the user's 400, not an engine error
        self.check_length(len(prompt_token_ids), params)
        arrival_time = time.time() if arrival_time is None else arrival_time
        if params.n == 1:
            return [EngineCoreRequest(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time, priority,
                                      is_final_only=is_final_only, lora=lora)]
        return [EngineCoreRequest(child_request_id(request_id, i), prompt_token_ids, _child_params(params, i),
                                  self.eos_token_ids, arrival_time, priority, parent_id=request_id,
                                  is_final_only=is_final_only, lora=lora)
                for i in range(params.n)]


def pooling_params() -> SamplingParams:
    """What a pooling request carries for the parts of the engine that read sampling parameters: one
    position past the prompt, never sampled (the runner pools instead)."""
    return SamplingParams(max_tokens=1, temperature=0.0)


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else params.seed + index
    return SamplingParams(**{**_fields(params), "n": 1, "seed": seed})


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}
