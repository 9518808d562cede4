"""Tool calling through the official `openai` client against a real server on a tiny random model (whose
ChatML template renders tools Hermes-style, so tool_choice "auto" uses the hermes parser).

tool_choice "required" and named are enforced by the engine's structured-output grammar. Parameter schemas
are bounded (strings with maxLength, bounded integers, enums) so that a random model finishes within max_tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest


WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
LOOKUP_PARAMS = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
                 "required": ["id"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "lookup", "description": "A record by id",
                                           "parameters": LOOKUP_PARAMS}}]
PARAMS = {"get_weather": WEATHER_PARAMS, "lookup": LOOKUP_PARAMS}
MESSAGES = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
BASE = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=400, temperature=0.0)
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, num: int | None = None) -> list[tuple[str, dict]]:
    """Each call's name and arguments, after checking them against the function's parameters."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMS[call.function.name])
        out.append((call.function.name, arguments))
    assert out and (num is None or len(out) == num)
    return out


def streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, str]], str]:
    """Content, calls (name, arguments) and finish reason reassembled from the stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                if delta.index not in calls:
                    assert delta.id.startswith("call_") and delta.type == "function"
                    assert delta.function.name and delta.function.arguments == ""
                    calls[delta.index] = [delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index][1] += delta.function.arguments
            finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def whole(out) -> tuple[str | None, list[tuple[str, str]], str]:
    choice = out.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return choice.message.content or None, calls, choice.finish_reason


def test_named_tool_choice(client):
    out = client.chat.completions.create(tool_choice=NAMED, **BASE)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a named function
    assert choice.message.content is None
    assert [name for name, _ in check_calls(choice.message.tool_calls, 1)] == ["get_weather"]


def test_required_tool_choice(client):
    out = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **BASE)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, 1)


def test_required_parallel_tool_calls(client):
    """Without maxItems a random model rarely closes the array: the calls it completed within max_tokens
    are returned (finish_reason "length"), each valid; the cut one stays in the content."""
    out = client.chat.completions.create(tool_choice="required", **{**BASE, "tools": TOOLS[1:], "max_tokens": 120})
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    assert {name for name, _ in check_calls(choice.message.tool_calls)} == {"lookup"}


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_stream_reassembles_to_the_same_calls(client, tool_choice):
    kwargs = dict(tool_choice=tool_choice, **BASE)
    assert streamed(client, **kwargs) == whole(client.chat.completions.create(**kwargs))


def test_auto_gives_content_or_valid_calls(client):
    out = client.chat.completions.create(**{**BASE, "temperature": 1.0, "max_tokens": 64}, seed=7)
    choice = out.choices[0]
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


def test_auto_stream_matches_non_stream(client):
    kwargs = dict(**{**BASE, "max_tokens": 48})
    assert streamed(client, **kwargs) == whole(client.chat.completions.create(**kwargs))


def test_tool_choice_none_gives_content(client):
    out = client.chat.completions.create(tool_choice="none", **{**BASE, "max_tokens": 8})
    assert out.choices[0].message.tool_calls is None and isinstance(out.choices[0].message.content, str)


HISTORY = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 degrees"}]


def test_history_with_tool_calls_is_rendered(server, client):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"messages": HISTORY, "tools": TOOLS}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tools>" in text  # the tools, in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 1}}\n' \
           "</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 degrees\n</tool_response><|im_end|>" in text
    out = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_conversation_continues_after_a_call_cut_off_by_max_tokens(client):
    """The first turn's call ends mid-arguments (finish_reason length); the client sends it back as it got it,
    and the next turn is answered (the template renders the text as it is)."""
    named = {"type": "function", "function": {"name": "get_weather"}}  # the call's arguments, token by token
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                           max_tokens=3)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "length" and not call.function.arguments.endswith("}")
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "unknown"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kwargs, word, param", [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "tools[0].type"),
    ({"tools": TOOLS + TOOLS[:1]}, "twice", "tools[2].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope", "tool_choice"),
    ({"tool_choice": "required"}, "tools", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name", "tools[0].function.name"),
    ({"functions": [{"name": "f"}]}, "functions", "functions"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id", "messages[0].tool_call_id"),
])
def test_invalid_tools_are_400_naming_the_field(client, kwargs, word, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **kwargs})
    assert word in e.value.body["message"] and e.value.body["param"] == param
