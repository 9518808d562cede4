"""OpenAI-compatible request and response records (msgspec: strict JSON decoding, fast encoding).

Decoding rejects malformed JSON, NaN/Infinity, out-of-range numbers and wrong types with a message
naming the field (-> 400). Request records forbid unknown fields: a field we do not implement (vLLM's
`use_beam_search`, `allowed_token_ids`, ...) is refused (400, naming it) rather than silently ignored.
The fields that constrain the output (`response_format`, `structured_outputs`, `guided_*`) are declared
here with their records in structured_fields.py, which turns them into StructuredOutputsParams. Known
OpenAI fields we do not support are declared so that their refusal can say why; the only fields accepted
and ignored are those of `IgnoredFields`, which never change an output.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from llmserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, KVTransferParams
from llmserve.server.protocol_tools import ChatTool, DeltaToolCall, ToolCall, ToolChoice
from llmserve.server.structured_fields import JsonSchema, ResponseFormat, StructuredOutputsRequest

# Ranges that SamplingParams.validate() enforces, declared here too so that /openapi.json states them
# (decoding then refuses a value out of range with a 400 naming the field, before SamplingParams does).
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
NumSequences = Annotated[int, Meta(ge=1, le=MAX_N)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Temperature = Annotated[float, Meta(ge=0.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
INT64_MAX = 2**63 - 1  # ints cross to the engine as msgpack: a larger one cannot be sent (it was a 500)
Int64 = Annotated[int, Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0)]
LogitBias = Annotated[float, Meta(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
ReasoningEffort = Literal["minimal", "low", "medium", "high"]
StopString = Annotated[str, Meta(min_length=1)]
StopStrings = Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]


def refused_unless(schema: dict[str, Any]) -> Any:
    """An OpenAI field decoded as any JSON but refused (params.py: 400, saying why) unless it has a neutral
    value; `schema`, shown in /openapi.json, says which values are accepted."""
    return Annotated[Any, Meta(extra_json_schema={**schema, "description": "not supported: only these values"})]


NULL: dict[str, Any] = {"type": "null"}
NULL_OR_EMPTY: dict[str, Any] = {"anyOf": [NULL, {"type": "array", "maxItems": 0}]}
NULL_OR_FALSE: dict[str, Any] = {"enum": [None, False]}
TEXT_ONLY: dict[str, Any] = {"anyOf": [NULL, {"type": "array", "items": {"enum": ["text"]}, "maxItems": 1}]}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class IgnoredFields(msgspec.Struct, kw_only=True):
    """The one list of fields accepted and ignored, as OpenAI does: bookkeeping (end-user ids, stored
    completions, billing tiers, cache keys) that never changes what is generated. Any other field we do
    not implement is refused with 400."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


IGNORED_FIELDS: tuple[str, ...] = IgnoredFields.__struct_fields__


class SamplingFields(IgnoredFields, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: NumSequences = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | StopStrings | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, LogitBias] | None = None
    best_of: PositiveInt | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegativeInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True  # false: this request opts out of speculative decoding
    priority: Int64 = 0
    return_token_ids: bool = False  # the prompt's and the output's token ids beside the text
    return_tokens_as_token_ids: bool = False  # logprobs name each token "token_id:<id>" (ids that decode to no text)
    # Output constraints (structured_fields.py): at most one a request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # "xgrammar" or "auto"
    guided_whitespace_pattern: refused_unless(NULL) = None
    # Disaggregated serving: set by the router on a prefill server's copy of the request (vLLM's field).
    kv_transfer_params: KVTransferParams | None = None


PromptItem = str | int | list[int]


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[PromptItem]
    echo: bool = False
    logprobs: NumLogprobs | None = None
    prompt_logprobs: NumLogprobs | None = None  # vLLM's: per prompt token its logprob, rank and top k
    suffix: refused_unless({"anyOf": [NULL, {"enum": [""]}]}) = None
    add_special_tokens: bool = True


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    """Lenient: clients send back assistant messages as they got them (`refusal`, `annotations`, ...).
    `tool_calls` only on assistant messages, `tool_call_id` only (and always) on tool messages."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default true: several calls may be returned
    # Passed to the chat template (a key the template never reads is refused): OpenAI's reasoning_effort,
    # vLLM's chat_template_kwargs (e.g. {"enable_thinking": false} for Qwen3)
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Declared to be refused (params.py) while unsupported.
    functions: refused_unless(NULL_OR_EMPTY) = None
    function_call: refused_unless(NULL) = None
    audio: refused_unless(NULL) = None
    modalities: refused_unless(TEXT_ONLY) = None
    prediction: refused_unless(NULL) = None


# ---- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> Usage:
    return Usage(num_prompt_tokens, num_completion_tokens, num_prompt_tokens + num_completion_tokens,
                 PromptTokensDetails(num_cached_tokens))


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptTokenLogprob(msgspec.Struct):
    """vLLM's Logprob record of a prompt token (keyed by token id in `prompt_logprobs`)."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's prompt_logprobs: None for the first prompt token, then {token id: logprob} for the prompt
    # token and its top k; only in a stream's first chunk of a choice.
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None
    # vLLM's return_token_ids: the prompt's ids (a stream's first chunk of a choice) and the output's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None = None


class ResponseMessage(msgspec.Struct):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET  # present only when calls were made
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET  # present with --reasoning-parser


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the thoughts' delta


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this delta's


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: on the stream's first chunk


class CompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    system_fingerprint: str | None = None
    usage: Usage | None = None


# ---- models, tokenizer, misc --------------------------------------------------------------------


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "llmserve"
    root: str | None = None
    max_model_len: int | None = None
    object: str = "model"
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's POST /v1/unload_lora_adapter body (lora_int_id, when given, must be the adapter's)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # with messages: rendered by the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # vLLM's: also each token's vocabulary string


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class TokenizerInfo(msgspec.Struct, omit_defaults=True):
    """GET /tokenizer_info (vLLM's): what a client needs to tokenize through /tokenize and render chats itself
    (lm-eval's remote tokenizer reads the special tokens and the chat template)."""
    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def decode_json(body: bytes, cls: type):
    """The request body as `cls`; msgspec errors become 400s (see errors.to_api_error)."""
    if not body.strip():
        raise ValueError("the request body is empty (send a JSON object)")
    return msgspec.json.decode(body, type=cls)


_ENCODER = msgspec.json.Encoder()


def encode_json(obj: Any) -> bytes:
    return _ENCODER.encode(obj)
