"""The request side of tool calling: checks (-> 400), the grammar of tool_choice required / named, the
assistant message and stream deltas, and tool messages handed to the chat template."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from llmserve.testing.toy_tokenizer import CHATML_TEMPLATE
from llmserve.server.protocol import ChatCompletionRequest, decode_json
from llmserve.server.serving_common import chat_conversation
from llmserve.server.tool_calls import ChoiceStream, plan_tools, required_schema, response_message
from llmserve.structured.grammar import validate

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 8},
                                                                          "unit": {"enum": ["c", "f"]}},
                                                           "required": ["city", "unit"]}}}
PING = {"type": "function", "function": {"name": "ping"}}


def request(**body) -> ChatCompletionRequest:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return decode_json(json.dumps(body).encode(), ChatCompletionRequest)


def plan(parser: str | None = None, template=CHATML_TEMPLATE, **body):
    return plan_tools(request(**body), parser, template)


@pytest.mark.parametrize("body, word", [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [PING, PING]}, "twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "only allowed when tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "ping"}}}, "only allowed when tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "object"),
])
def test_invalid_tools(body, word):
    with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
        plan(**body)


def test_auto_needs_a_parser():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        plan(template="{{ messages }}", tools=[WEATHER])
    assert plan("llama3_json", template="{{ messages }}", tools=[WEATHER]).parser_cls.name == "llama3_json"
    assert plan(template="{{ messages }}", tools=[WEATHER], tool_choice="required").mode == "required"


def test_modes():
    assert plan().mode == "none" and plan(tool_choice="none").mode == "none"
    assert plan(tools=[WEATHER]).mode == "auto" and plan(tools=[WEATHER]).parser_cls.name == "hermes"
    named = plan(tools=[WEATHER, PING], tool_choice={"type": "function", "function": {"name": "ping"}})
    assert (named.mode, named.named) == ("named", "ping")
    assert json.loads(named.structured_outputs().json) == {"type": "object"}
    assert plan(tools=[WEATHER], parallel_tool_calls=False).max_calls == 1


@pytest.mark.parametrize("is_parallel", [True, False])
def test_required_schema_compiles_and_accepts_calls(is_parallel):
    p = plan(tools=[WEATHER, PING], tool_choice="required", parallel_tool_calls=is_parallel)
    constraint = p.structured_outputs()
    validate(constraint)  # xgrammar compiles it
    schema = json.loads(constraint.json)
    one = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "parameters": {"city": "x"}} | {"extra": 1}], schema)
    two = one + [{"name": "ping", "parameters": {}}]
    if is_parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)


def test_required_schema_lifts_defs():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}
    schema = required_schema(request(tools=[tool]).tools, True)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


def test_apply_refuses_a_second_constraint():
    p = plan(tools=[WEATHER], tool_choice="required")
    overrides = {"structured_outputs": p.structured_outputs()}
    with pytest.raises(ValueError, match="cannot be combined"):
        p.apply(overrides)
    overrides = {}
    p.apply(overrides)
    assert overrides["structured_outputs"] == p.structured_outputs()


def test_response_messages():
    auto = plan(tools=[WEATHER])
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    message, finish = response_message(auto, text, "stop")
    assert finish == "tool_calls" and message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})]
    assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"
    message, finish = response_message(auto, "plain", "length")
    assert (message.content, message.tool_calls, finish) == ("plain", msgspec.UNSET, "length")
    named = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message, finish = response_message(named, '{"city":"Oslo","unit":"f"}', "stop")
    assert finish == "stop" and message.content is None and message.tool_calls[0].function.name == "get_weather"
    required = plan(tools=[WEATHER, PING], tool_choice="required")
    message, finish = response_message(required, '[{"name":"ping","parameters":{}}]', "stop")
    assert finish == "tool_calls" and [c.function.name for c in message.tool_calls] == ["ping"]


def test_named_stream_sends_arguments_as_they_come():
    named = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    stream = ChoiceStream(named)
    first = stream.feed('{"ci', False)
    assert first[0].tool_calls[0].function.name == "get_weather" and first[0].tool_calls[0].function.arguments == ""
    assert first[0].tool_calls[0].id.startswith("call_") and first[1].tool_calls[0].function.arguments == '{"ci'
    assert stream.feed('ty":"x","unit":"c"}', True)[0].tool_calls[0].function.arguments == 'ty":"x","unit":"c"}'
    assert stream.finish_reason("stop") == "stop"


def test_tool_messages_reach_the_template():
    req = request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    conversation = chat_conversation(req.messages)
    assert conversation[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert conversation[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("text, arguments", [("", {}), ("  ", {}), ('{"city": "Par', '{"city": "Par'),
                                             ("[1]", "[1]"), ('{"city": "Oslo"}', {"city": "Oslo"})])
def test_a_call_cut_off_in_the_history_reaches_the_template_as_it_is(text, arguments):
    """An earlier turn's call cut off by max_tokens (LangChain sends it back): empty is {}, other text stays text."""
    req = request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": text}}]}])
    assert chat_conversation(req.messages)[1]["tool_calls"][0]["function"]["arguments"] == arguments


@pytest.mark.parametrize("message, word", [
    ({"role": "tool", "content": "x"}, "tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "c"}, "tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": []}, "only assistant"),
])
def test_invalid_tool_messages(message, word):
    with pytest.raises(ValueError, match=word):
        chat_conversation(request(messages=[message]).messages)


def test_tool_call_parser_flag():
    from llmserve.server.cli import main  # noqa: F401 - the flag comes from ServerConfig
    from llmserve.server.config import ServerConfig

    assert ServerConfig(tool_call_parser="mistral").tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="tool-call-parser"):
        ServerConfig(tool_call_parser="bogus")


# ---- outputs sampled under the grammar (what the engine does, here with xgrammar and random logits) ----


def sample_under_grammar(constraint, seed: int, max_tokens: int = 400) -> str:
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from llmserve.testing.toy_tokenizer import EOS_TOKEN, build_tokenizer
    from llmserve.structured.grammar import build_grammar

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(512), eos_token=EOS_TOKEN)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(build_grammar(constraint)))
    bitmask, generator, token_ids = xgr.allocate_token_bitmask(1, 512), torch.Generator().manual_seed(seed), []
    for _ in range(max_tokens):
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.randn(1, 512, generator=generator)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token_id in info.stop_token_ids:
            return tokenizer.decode(token_ids)
        assert matcher.accept_token(token_id)
        token_ids.append(token_id)
    raise AssertionError("the output did not end within max_tokens")


BOUNDED = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "tag": {"type": "string", "maxLength": 6}},
    "required": ["id", "tag"], "additionalProperties": False}}}
ENUM_ONLY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}
SCHEMAS = {"lookup": BOUNDED["function"]["parameters"], "get_weather": ENUM_ONLY["function"]["parameters"]}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_grammar_outputs_become_valid_calls(choice, seed):
    p = plan(tools=[BOUNDED, ENUM_ONLY], tool_choice=choice, parallel_tool_calls=seed % 2 == 0)
    text = sample_under_grammar(p.structured_outputs(), seed)
    message, finish = response_message(p, text, "stop")
    assert finish == ("stop" if p.mode == "named" else "tool_calls")
    assert message.tool_calls and (p.is_parallel or len(message.tool_calls) == 1)
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    stream, deltas = ChoiceStream(p), []
    for i in range(0, len(text), 3):
        deltas += stream.feed(text[i:i + 3], False)
    deltas += stream.feed("", True)
    streamed: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.tool_calls or ():
            entry = streamed.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [(c.function.name, c.function.arguments)
                                                              for c in message.tool_calls]
