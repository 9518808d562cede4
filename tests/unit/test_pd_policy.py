"""The P/D placement rules (router/pd_policy.py) that the router and the Ray Serve P/D ingress share: each
rule's decision from a prompt length and the load counted in flight."""

import pytest

from llmserve.router.pd_policy import PDLoad, PDPolicy, PrefillPlace, place_prefill, prompt_length_query

IDLE = PDLoad(num_decode_in_flight=0, num_prefill_servers=2, num_busy_prefill_servers=0,
              num_long_busy_prefill_servers=0)
BUSY_LONG = PDLoad(3, 2, 2, 2)  # both prefill servers compute a long prompt; streams decode on the decode server
BUSY_SHORT = PDLoad(3, 2, 2, 1)  # one prefill server has only short prompts in flight
BUSY_IDLE_DECODE = PDLoad(0, 2, 2, 0)


@pytest.mark.parametrize("policy, length, load, place", [
    (PDPolicy(), 5, BUSY_LONG, PrefillPlace.PREFILL_SERVER),  # no rule: always the prefill servers
    (PDPolicy(max_local_prefill_length=8), 8, IDLE, PrefillPlace.LOCAL_SHORT),
    (PDPolicy(max_local_prefill_length=8), 9, IDLE, PrefillPlace.PREFILL_SERVER),
    (PDPolicy(max_local_prefill_length=8), None, IDLE, PrefillPlace.PREFILL_SERVER),  # unknown length
    (PDPolicy(max_local_prefill_length_if_busy=64), 64, BUSY_LONG, PrefillPlace.LOCAL_BESIDE_LONG),
    (PDPolicy(max_local_prefill_length_if_busy=64), 64, BUSY_SHORT, PrefillPlace.PREFILL_SERVER),  # a short wait
    (PDPolicy(max_local_prefill_length_if_busy=64), 64, IDLE, PrefillPlace.PREFILL_SERVER),
    (PDPolicy(max_local_prefill_length_if_busy=64), 65, BUSY_LONG, PrefillPlace.PREFILL_SERVER),  # never long
    (PDPolicy(max_local_prefill_length_if_busy=64), None, BUSY_LONG, PrefillPlace.PREFILL_SERVER),
    (PDPolicy(prefill_on_idle_decode=True), 5000, BUSY_IDLE_DECODE, PrefillPlace.IDLE_DECODE),
    (PDPolicy(prefill_on_idle_decode=True), None, BUSY_IDLE_DECODE, PrefillPlace.IDLE_DECODE),
    (PDPolicy(prefill_on_idle_decode=True), 5000, BUSY_LONG, PrefillPlace.PREFILL_SERVER),  # a stream decodes
    (PDPolicy(prefill_on_idle_decode=True), 5000, PDLoad(0, 2, 1, 1), PrefillPlace.PREFILL_SERVER),  # one free
    (PDPolicy(8, 64, True), 8, BUSY_LONG, PrefillPlace.LOCAL_SHORT),  # first match wins
    (PDPolicy(8, 64, True), 30, PDLoad(0, 2, 2, 2), PrefillPlace.LOCAL_BESIDE_LONG),
])
def test_place_prefill(policy, length, load, place):
    assert place_prefill(policy, length, load) is place
    assert place.is_local == (place is not PrefillPlace.PREFILL_SERVER)


def test_a_prompt_of_unknown_length_counts_as_long():
    policy = PDPolicy(max_local_prefill_length_if_busy=64)
    assert (policy.is_long(None), policy.is_long(65), policy.is_long(64)) == (True, True, False)
    assert not PDPolicy(prefill_on_idle_decode=True).needs_prompt_length
    assert policy.needs_prompt_length and PDPolicy(max_local_prefill_length=1).needs_prompt_length


@pytest.mark.parametrize("name", ["max_local_prefill_length", "max_local_prefill_length_if_busy"])
def test_negative_lengths_are_refused_naming_the_flag(name):
    with pytest.raises(ValueError, match=f"^--{name.replace('_', '-')}: must be >= 0"):
        PDPolicy(**{name: -1})


@pytest.mark.parametrize("body, query", [
    ({"prompt": [1, 2, 3]}, 3),
    ({"prompt": "hi"}, {"prompt": "hi"}),
    ({"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "user", "content": "hi"}]}),
    ({"prompt": ["a", "b"]}, None),  # a batch
    ({"prompt": [[1], [2]]}, None),
    ({}, None),
])
def test_prompt_length_query(body, query):
    assert prompt_length_query(body) == query
