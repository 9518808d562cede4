"""SamplingParams validation: every bad value is rejected with a ValueError naming the parameter."""

import math

import msgspec
import pytest

from llmserve.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, SamplingParams

INVALID = [
    ("n", 0), ("n", MAX_N + 1), ("n", 1.5), ("n", True),
    ("max_tokens", 0), ("max_tokens", -3),
    ("min_tokens", -1),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "0.5"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan),
    ("top_k", -2),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", math.nan),
    ("presence_penalty", 2.01), ("presence_penalty", -2.01), ("presence_penalty", math.inf),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.5), ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("logit_bias", {5: 100.5}), ("logit_bias", {5: -101.0}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: math.nan}), ("logit_bias", {"5": 1.0}),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", [""]), ("stop", ["ok", ""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1, -5]),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1),
    ("seed", 2**64), ("seed", -(2**63) - 1),
]

VALID = [
    {}, {"n": MAX_N}, {"max_tokens": None}, {"max_tokens": 1}, {"min_tokens": 16, "max_tokens": 16},
    {"min_tokens": 100, "max_tokens": None}, {"temperature": 0.0}, {"temperature": 2},
    {"top_p": 1e-9}, {"top_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"top_k": 10**6},
    {"min_p": 0.0}, {"min_p": 1.0}, {"presence_penalty": -2.0}, {"frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3}, {"logit_bias": {0: -100, 7: 100.0}}, {"stop": "x"},
    {"stop": ["x"] * MAX_STOP_STRINGS}, {"stop_token_ids": [0, 7]}, {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS}, {"seed": 0}, {"seed": 2**64 - 1}, {"seed": -(2**63)},
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}"[:40] for n, v in INVALID])
def test_invalid_value_is_rejected_naming_the_parameter(name, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{name: value})
    assert name in str(info.value)


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(k)[:40] for k in VALID])
def test_valid_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=17, max_tokens=16)


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_validate_for_vocab_checks_logit_bias_and_stop_token_ids():
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).validate_for_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).validate_for_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[3, 10]).validate_for_vocab(10)


def test_decoding_validates_too():
    with pytest.raises(ValueError, match="top_p"):  # msgspec.ValidationError is a ValueError
        msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)
    params = msgspec.json.decode(b'{"logit_bias": {"5": 1.5}, "stop": ["a"]}', type=SamplingParams)
    assert params.logit_bias == {5: 1.5}
