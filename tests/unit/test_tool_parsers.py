"""Tool-call parsers: whole texts (0, 1, several calls, text around them, malformed JSON left as content),
and the same texts streamed in random pieces reassembling to the whole-text result."""

from __future__ import annotations

import json
import random

import pytest

from llmserve.server.reasoning import reasoning_stream, split_reasoning
from llmserve.server.tool_parsers import (PARSERS, HarmonyParser, HermesParser, JsonArrayParser, Llama3JsonParser,
                                          MistralParser, ParsedCall, ParsedOutput, ToolCallStream, detect_parser,
                                          parse_output, resolve_parser)
from llmserve.testing.toy_tokenizer import CHATML_TEMPLATE

NAMES = frozenset({"get_weather", "add"})
WEATHER = ParsedCall("get_weather", '{"city":"Paris","unit":"c"}')
ADD = ParsedCall("add", '{"a":1,"b":[2,"}"]}')


def hermes_call(name: str, args: dict, key: str = "arguments") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, key: args})}\n</tool_call>'


def llama_call(name: str, args: dict) -> str:
    return json.dumps({"name": name, "parameters": args})


W_ARGS, A_ARGS = {"city": "Paris", "unit": "c"}, {"a": 1, "b": [2, "}"]}


def harmony_call(name: str, arguments: str) -> str:
    """A gpt-oss message to a function, without the <|call|> that ends it (gpt-oss's EOS, not in the text)."""
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"


ANALYSIS = "<|channel|>analysis<|message|>"

CASES = [
    # (parser, text, content, calls)
    (HermesParser, "Just text, no calls.", "Just text, no calls.", []),
    (HermesParser, "", "", []),
    (HermesParser, hermes_call("get_weather", W_ARGS), None, [WEATHER]),
    (HermesParser, "Let me check.\n" + hermes_call("get_weather", W_ARGS) + "\n" + hermes_call("add", A_ARGS),
     "Let me check.\n\n", [WEATHER, ADD]),
    (HermesParser, hermes_call("get_weather", W_ARGS) + " \n" + hermes_call("add", A_ARGS) + "\n", None,
     [WEATHER, ADD]),
    (HermesParser, "a <tool_call>{not json}</tool_call> b", "a <tool_call>{not json}</tool_call> b", []),
    (HermesParser, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    (HermesParser, 'x <tool_call>{"name": "add", "arguments": {"a"', 'x <tool_call>{"name": "add", "arguments": {"a"',
     []),
    (HermesParser, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2, "}"]}}', None, [ADD]),  # no end tag
    (HermesParser, "<tool_call>" + json.dumps({"name": "add", "arguments": json.dumps(A_ARGS)}) + "</tool_call>",
     None, [ADD]),  # arguments sent as JSON text
    (HermesParser, "a < b <tool_ca", "a < b <tool_ca", []),
    (HermesParser, '<tool_call>{"name": "add", "arguments": {"s": "raw\x07\n"}}</tool_call>', None,
     [ParsedCall("add", '{"s":"raw\\u0007\\n"}')]),  # raw control characters in strings, escaped
    (Llama3JsonParser, "Paris is sunny.", "Paris is sunny.", []),
    (Llama3JsonParser, llama_call("get_weather", W_ARGS), None, [WEATHER]),
    (Llama3JsonParser, "<|python_tag|>" + llama_call("get_weather", W_ARGS) + "; " + llama_call("add", A_ARGS),
     None, [WEATHER, ADD]),
    (Llama3JsonParser, "\n " + llama_call("add", A_ARGS) + ";" + llama_call("get_weather", W_ARGS), None,
     [ADD, WEATHER]),
    (Llama3JsonParser, "Sure: <|python_tag|>" + llama_call("add", A_ARGS) + " done", "Sure: done",
     [ADD]),
    (Llama3JsonParser, "text then " + llama_call("add", A_ARGS), "text then " + llama_call("add", A_ARGS), []),
    (Llama3JsonParser, '{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": {"a": 1', []),
    (Llama3JsonParser, '{"nam": "add"} rest', '{"nam": "add"} rest', []),
    (Llama3JsonParser, llama_call("add", A_ARGS) + '; {"bad": 1}', '{"bad": 1}', [ADD]),
    (MistralParser, "No tools needed.", "No tools needed.", []),
    (MistralParser, "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": W_ARGS}]), None, [WEATHER]),
    (MistralParser, "Checking. [TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": W_ARGS},
                                                            {"name": "add", "arguments": A_ARGS}]) + "\n",
     "Checking. \n", [WEATHER, ADD]),
    (MistralParser, '[TOOL_CALLS][{"name": "add", "arguments": }]', '[TOOL_CALLS][{"name": "add", "arguments": }]', []),
    (MistralParser, "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    (MistralParser, "cut [TOOL_CALLS][{\"name\": \"add\"", "cut [TOOL_CALLS][{\"name\": \"add\"", []),
    (HarmonyParser, "Paris is sunny.", "Paris is sunny.", []),
    (HarmonyParser, harmony_call("get_weather", json.dumps(W_ARGS)), None, [WEATHER]),
    (HarmonyParser, harmony_call("get_weather", json.dumps(W_ARGS)) + "<|call|>", None, [WEATHER]),
    (HarmonyParser, "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>" + json.dumps(A_ARGS)
     + "<|call|>", None, [ADD]),  # the recipient in the role part
    (HarmonyParser, "Let me look.<|start|>assistant" + harmony_call("add", json.dumps(A_ARGS)), "Let me look.",
     [ADD]),
    (HarmonyParser, f"{ANALYSIS}think<|end|><|start|>assistant" + harmony_call("add", json.dumps(A_ARGS)),
     f"{ANALYSIS}think<|end|>", [ADD]),  # a raw harmony output: its other messages stay as they are
    (HarmonyParser, harmony_call("unknown", "{}") + "<|call|>", harmony_call("unknown", "{}") + "<|call|>", []),
    (HarmonyParser, harmony_call("add", '{"a": 1'), harmony_call("add", '{"a": 1'), []),  # cut off: not JSON
    (HarmonyParser, "text <|channel|>commentary to=functions.add", "text <|channel|>commentary to=functions.add",
     []),
    (HarmonyParser, "a <|chan", "a <|chan", []),
    (JsonArrayParser, json.dumps([{"name": "get_weather", "parameters": W_ARGS}]), None, [WEATHER]),
    (JsonArrayParser, json.dumps([{"name": "get_weather", "parameters": W_ARGS}, {"name": "add", "parameters": A_ARGS}],
                                 indent=2), None, [WEATHER, ADD]),
    (JsonArrayParser, '[{"name": "add", "parameters": {"a": 1, "b": [2, "}"]}}, {"name": "get_w',
     '{"name": "get_w', [ADD]),
]


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_parse_whole_text(cls, text, content, calls):
    assert parse_output(cls(NAMES), text) == ParsedOutput(content, calls)


def stream_in_pieces(cls, text: str, seed: int, max_calls: int | None = None) -> ParsedOutput:
    rng = random.Random(seed)
    stream = ToolCallStream(cls(NAMES), max_calls)
    deltas, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 8)
        deltas += stream.feed(text[pos:pos + size])
        pos += size
    deltas += stream.feed("", final=True)
    calls = [d.call for d in deltas if d.call is not None]
    assert [d.index for d in deltas if d.call is not None] == list(range(len(calls)))
    content = "".join(d.content for d in deltas if d.content is not None)
    return ParsedOutput(content or None, calls)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_stream_reassembles_to_whole(cls, text, content, calls, seed):
    whole = parse_output(cls(NAMES), text)
    streamed = stream_in_pieces(cls, text, seed)
    assert streamed.calls == whole.calls
    assert (streamed.content or None) == (whole.content or None)


def test_stream_holds_back_a_marker_start():
    stream = ToolCallStream(HermesParser(NAMES))
    assert [d.content for d in stream.feed("Hi <tool")] == ["Hi "]
    assert stream.feed('_call>{"name": "add", "arguments": {}}') == []
    deltas = stream.feed("</tool_call>")
    assert [d.call for d in deltas] == [ParsedCall("add", "{}")]


def test_stream_sends_content_as_it_comes():
    stream = ToolCallStream(HermesParser(NAMES))
    assert [d.content for d in stream.feed("Hello")] == ["Hello"]
    assert [d.content for d in stream.feed(" world")] == [" world"]


def test_max_calls_keeps_the_first():
    text = hermes_call("get_weather", W_ARGS) + hermes_call("add", A_ARGS)
    assert parse_output(HermesParser(NAMES), text, max_calls=1).calls == [WEATHER]
    assert stream_in_pieces(HermesParser, text, 0, max_calls=1).calls == [WEATHER]


def test_detect_parser():
    assert detect_parser(CHATML_TEMPLATE) == "hermes"
    assert detect_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("{% if message.role == 'ipython' %}") == "llama3_json"
    assert detect_parser({"default": "[TOOL_CALLS]"}) == "mistral"
    assert detect_parser("{{ messages }}") is None and detect_parser(None) is None
    assert resolve_parser("mistral", CHATML_TEMPLATE) is MistralParser
    assert resolve_parser(None, CHATML_TEMPLATE) is HermesParser
    assert detect_parser("{{ '<|start|>assistant to=functions.' + name + '<|call|>' }}") == "openai"
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "openai"}


GPT_OSS_OUTPUTS = [
    # (output, reasoning, content, calls): the gpt_oss reasoning parser, then the openai tool-call parser
    (f"{ANALYSIS}The user wants <|weather|>.<|end|><|start|>assistant"
     + harmony_call("get_weather", json.dumps(W_ARGS)),
     "The user wants <|weather|>.", None, [WEATHER]),
    (f"{ANALYSIS}add them<|end|><|start|>assistant" + harmony_call("add", json.dumps(A_ARGS)) + "<|call|>",
     "add them", None, [ADD]),
    (f"{ANALYSIS}no tool needed<|end|><|start|>assistant<|channel|>final<|message|>It is <|sunny|>.<|return|>",
     "no tool needed", "It is <|sunny|>.", []),
    (f"{ANALYSIS}hmm<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
     + harmony_call("add", json.dumps(A_ARGS)), "hmm", "Checking.", [ADD]),
]


@pytest.mark.parametrize("text, reasoning, content, calls", GPT_OSS_OUTPUTS)
def test_a_whole_gpt_oss_output_gives_its_thoughts_answer_and_calls(text, reasoning, content, calls):
    split = split_reasoning("gpt_oss", text)
    assert split.reasoning == reasoning
    assert parse_output(HarmonyParser(NAMES), split.content) == ParsedOutput(content, calls)


@pytest.mark.parametrize("text, reasoning, content, calls", GPT_OSS_OUTPUTS)
def test_every_cut_of_a_gpt_oss_stream_gives_the_whole_outputs_calls(text, reasoning, content, calls):
    """Streamed in pieces of every size, the thoughts through the reasoning parser, what it leaves through the
    tool-call parser (as a chat stream does): the same thoughts, answer and calls as the whole output."""
    for size in range(1, len(text) + 1):
        thoughts, tools = reasoning_stream("gpt_oss"), ToolCallStream(HarmonyParser(NAMES))
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        streamed_reasoning, deltas = "", []
        for i, piece in enumerate(pieces):
            thought, answer = thoughts.feed(piece, i == len(pieces) - 1)
            streamed_reasoning += thought
            deltas += tools.feed(answer, i == len(pieces) - 1)
        assert streamed_reasoning == reasoning, size
        assert [d.call for d in deltas if d.call is not None] == calls, size
        assert ("".join(d.content for d in deltas if d.content is not None) or None) == content, size
