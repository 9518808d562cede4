"""OpenAI/TGI request fields -> SamplingParams (defaults from the model's generation_config).

Only fields the user set are passed on, so the model's generation defaults fill the rest; every
check raises FieldError (-> 400 naming the field).
"""

from __future__ import annotations

from llmserve.sampling_params import MAX_LOGPROBS, SamplingParams
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from llmserve.server.structured_fields import FieldError, request_structured_outputs

_SIMPLE_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                  "repetition_penalty", "stop_token_ids")


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        if token_id < 0:
            raise FieldError("logit_bias", f"logit_bias: token id {token_id} is negative")
        bias[token_id] = value
    return bias


def _stop(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else list(stop)


def check_common(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise FieldError("stream_options", "stream_options is only allowed when stream is true")
    if req.best_of is not None and req.best_of != req.n:
        raise FieldError("best_of", f"best_of={req.best_of} other than n is not supported")


def common_overrides(req: SamplingFields) -> dict:
    """The sampling fields the request set, in SamplingParams' names."""
    check_common(req)
    overrides = {name: getattr(req, name) for name in _SIMPLE_FIELDS if getattr(req, name) is not None}
    overrides.update(n=req.n, stop=_stop(req.stop), logit_bias=_logit_bias(req.logit_bias),
                     min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                     include_stop_str_in_output=req.include_stop_str_in_output,
                     skip_special_tokens=req.skip_special_tokens, speculative=req.speculative,
                     structured_outputs=request_structured_outputs(req), kv_transfer_params=req.kv_transfer_params)
    return overrides


def completion_overrides(req: CompletionRequest) -> dict:
    if req.suffix:
        raise FieldError("suffix", "suffix is not supported")
    overrides = common_overrides(req)
    overrides["max_tokens"] = 16 if req.max_tokens is None else req.max_tokens
    overrides["logprobs"] = req.logprobs
    if req.prompt_logprobs is not None or (req.echo and req.logprobs is not None):
        # echo with logprobs scores the echoed prompt too (OpenAI), with as many top tokens
        echoed = req.logprobs if req.echo and req.logprobs is not None else 0
        overrides["prompt_logprobs"] = max(req.prompt_logprobs or 0, echoed)
    return overrides


def _check_chat_unsupported(req: ChatCompletionRequest) -> None:
    if req.functions or req.function_call is not None:  # tools: server/tool_calls.py
        raise FieldError("functions" if req.functions else "function_call",
                         "functions / function_call are deprecated and not supported: send tools and tool_choice")
    if req.audio is not None or (req.modalities and req.modalities != ["text"]):
        raise FieldError("audio" if req.audio is not None else "modalities",
                         "only text output is supported (audio / modalities)")
    if req.prediction is not None:
        raise FieldError("prediction", "prediction (predicted outputs) is not supported")


def chat_overrides(req: ChatCompletionRequest) -> dict:
    _check_chat_unsupported(req)
    overrides = common_overrides(req)
    overrides["max_tokens"] = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise FieldError("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
    overrides["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    return overrides


def build_params(defaults_factory, overrides: dict) -> SamplingParams:
    """`defaults_factory` is AsyncLLM.default_sampling_params (the model's defaults under overrides)."""
    params = defaults_factory(**overrides)
    assert isinstance(params, SamplingParams)
    return params
