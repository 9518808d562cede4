"""Per-request sampling parameters: what the user asked for, validated once at the boundary."""

from __future__ import annotations

import json
import math

import msgspec

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_LOGIT_BIAS = 100.0
MIN_SEED = -(2**63)  # torch.Generator.manual_seed accepts [-2**63, 2**64)
MAX_SEED = 2**64 - 1


class ParamError(ValueError):
    """A bad request parameter, named (`param`, as OpenAI's errors name it) where it is checked; the server
    answers 400 with that name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """One output constraint (vLLM's `structured_outputs` names); exactly one of the six is set.

    `json`: a JSON schema as compact JSON text (its key order kept: properties come out in that order);
    `regex`: a regular expression the whole output matches; `choice`: the output is one of these strings;
    `grammar`: an EBNF grammar (GBNF dialect, root rule `root`); `json_object`: any JSON object;
    `structural_tag`: xgrammar's structural tag as JSON text (fixed strings, free text and JSON schemas in
    sequence; the server builds one for a model's tool-call syntax), its JSON schemas held as `json`'s are.
    `disable_any_whitespace`: JSON without whitespace between tokens (otherwise bounded whitespace).
    `strict` (JSON schemas): objects hold only the properties the schema names unless it allows more
    (OpenAI's strict); false: what the schema allows. `best_effort`: keywords the grammar cannot enforce
    are left unenforced (and reported) instead of refused. `bound_numbers` (JSON schemas): integers without
    bounds of their own stay within int64's range and numbers within +-(2**53 - 1), so a model cannot write
    digits until max_tokens; false: what the schema says, unbounded.
    Syntax is checked by llmserve.structured.validate (the front calls it, so a bad one is a 400).
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    strict: bool = True
    best_effort: bool = False
    bound_numbers: bool = True
    # Set by the server's reasoning parser: the grammar starts after the output holds these ids (the end of
    # the model's thoughts, e.g. </think>); until then any token may come. None: from the first token.
    reasoning_end: list[int] | None = None

    @classmethod
    def from_json_schema(cls, schema: dict | str | bool, **kwargs) -> StructuredOutputsParams:
        """`schema` as a dict (or JSON text, parsed: ValueError if it is not JSON) -> compact text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls(json=json.dumps(schema, separators=(",", ":")), **kwargs)

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar, structural_tag or json_object."""
        kinds = self.kinds()
        assert len(kinds) == 1, "validate() first"
        return kinds[0]

    def kinds(self) -> list[str]:
        set_kinds = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                     if getattr(self, name) is not None]
        return set_kinds + (["json_object"] if self.json_object else [])

    def validate(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar, structural_tag, "
                             f"json_object; got {kinds or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must hold non-empty strings")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        if self.reasoning_end is not None and (not self.reasoning_end or not all(
                isinstance(t, int) and t >= 0 for t in self.reasoning_end)):
            raise ValueError("reasoning_end must be a non-empty list of token ids")

    @property
    def cache_key(self) -> tuple:
        """Requests with equal keys share one compiled grammar."""
        spec = tuple(self.choice) if self.choice is not None else getattr(self, self.kind)
        return self.kind, spec, self.disable_any_whitespace, self.strict, self.best_effort, self.bound_numbers


class KVTransferParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Disaggregated serving (vLLM's field name, set by the router): the prefill server that runs this request
    sends its prompt's KV blocks to the decode server's KV receiver at `decode_kv_address` (tcp://HOST:PORT)
    when the request finishes (engine/kv_transfer.py)."""

    decode_kv_address: str

    def validate(self) -> None:
        host, _, port = self.decode_kv_address.removeprefix("tcp://").rpartition(":")
        if not self.decode_kv_address.startswith("tcp://") or not host or not port.isdigit():
            raise ParamError("kv_transfer_params", f"kv_transfer_params.decode_kv_address must be tcp://HOST:PORT, "
                             f"got {self.decode_kv_address!r}")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters of one request (vLLM's names and meanings).

    `top_k` <= 0 and `top_p` == 1 disable those filters; `temperature` == 0 is greedy.
    `logprobs` = None returns none; k >= 0 returns the sampled token's logprob plus the top k.
    `prompt_logprobs` = k: the same for every prompt token after the first (computed, so such a
    request takes no prefix-cache hit).
    Validation (`validate()`) raises ValueError naming the parameter.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    speculative: bool = True  # False opts this request out of speculative decoding
    structured_outputs: StructuredOutputsParams | None = None  # constrains the output (llmserve.structured)
    kv_transfer_params: KVTransferParams | None = None  # disaggregation: where the prompt's KV blocks go

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ParamError (a ValueError) naming the first invalid parameter."""
        self._validate_counts()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_stops()
        _check_logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
            if self.min_tokens:  # the grammar decides where the output ends
                raise ParamError("min_tokens", "min_tokens cannot be combined with structured outputs")
        if self.kv_transfer_params is not None:
            self.kv_transfer_params.validate()

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Check the token ids the user gave (logit_bias keys, stop_token_ids) against the vocabulary."""
        for token_id in self.logit_bias or ():
            if token_id >= vocab_size:
                raise ParamError("logit_bias",
                                 f"logit_bias: token id {token_id} is out of the vocabulary (size {vocab_size})")
        for token_id in self.stop_token_ids or ():
            if token_id >= vocab_size:
                raise ParamError("stop_token_ids",
                                 f"stop_token_ids: token id {token_id} is out of the vocabulary (size {vocab_size})")

    def _validate_counts(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, MIN_SEED, MAX_SEED)

    def _validate_sampling(self) -> None:
        _check_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ParamError("temperature", f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise ParamError(name, f"{name} must be in [-2, 2], got {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ParamError("repetition_penalty",
                             f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")

    def _validate_stops(self) -> None:
        if self.stop is not None:
            if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS:
                raise ParamError("stop", f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")
            for stop_str in self.stop:
                if not isinstance(stop_str, str) or not stop_str:
                    raise ParamError("stop", f"stop strings must be non-empty strings, got {stop_str!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                raise ParamError("stop_token_ids", "stop_token_ids must be a list of token ids")
            for token_id in self.stop_token_ids:
                _check_int("stop_token_ids", token_id, 0, None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    """ParamError unless `value` is an int (not a bool) in [low, high] (high None: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ParamError(name, f"{name} must be {bound}, got {value}")


def _check_float(name: str, value: object) -> None:
    """ParamError unless `value` is a finite real number (ints allowed, bools and NaN/inf not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ParamError(name, f"{name} must be finite, got {value}")


def _check_logit_bias(logit_bias: dict[int, float] | None) -> None:
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise ParamError("logit_bias", "logit_bias must be a mapping of token id to bias")
    for token_id, bias in logit_bias.items():
        _check_int("logit_bias", token_id, 0, None)
        _check_float("logit_bias", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
