"""server/reasoning.py: thoughts apart from the answer, whole or streamed in any cut."""

from __future__ import annotations

import pytest

from llmserve.server.reasoning import ReasoningStream, Split, reasoning_stream, split_reasoning


@pytest.mark.parametrize("parser, text, want", [
    ("deepseek_r1", "let me see</think>\n\nParis", Split("let me see", "Paris")),
    ("deepseek_r1", "<think>let me see</think>Paris", Split("let me see", "Paris")),
    ("deepseek_r1", "still thinking", Split("still thinking", "")),  # cut by max_tokens: all thought
    ("qwen3", "<think>\nhmm\n</think>\n\nParis", Split("\nhmm\n", "Paris")),
    ("qwen3", "Paris", Split(None, "Paris")),  # thinking turned off
    ("qwen3", "  <think>a</think>b", Split("a", "b")),
    ("qwen3", "<thin", Split(None, "<thin")),  # the end: no tag after all
    ("qwen3", "<think>x</thi", Split("x</thi", "")),
])
def test_a_whole_output_is_split(parser, text, want):
    assert split_reasoning(parser, text) == want


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", ["<think>a < b, so</think>\nyes <think> stays", "no thoughts</think>?",
                                  "<think>x</think>"])
def test_every_cut_of_a_stream_gives_the_whole_split(parser, text):
    """Fed in pieces of every size (tags cut anywhere), the deltas join to what the whole output splits into."""
    want = split_reasoning(parser, text)
    for size in range(1, len(text) + 1):
        stream = ReasoningStream(parser)
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        deltas = [stream.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        reasoning, content = "".join(r for r, _ in deltas), "".join(c for _, c in deltas)
        assert (reasoning if stream.has_reasoning else None, content) == (want.reasoning, want.content), size


ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"


@pytest.mark.parametrize("text, want", [
    (f"{ANALYSIS}a < b, so<|end|>{FINAL}Paris<|return|>", Split("a < b, so", "Paris")),
    (f"{ANALYSIS}think<|end|>{FINAL}Paris", Split("think", "Paris")),  # the EOS not in the text
    (f"{ANALYSIS}think<|end|>{FINAL}Paris<|endoftext|>", Split("think", "Paris")),
    (f"{ANALYSIS}cut off by max_tokens", Split("cut off by max_tokens", "")),
    ("<|channel|>final<|message|>Paris<|return|>", Split(None, "Paris")),
    ("Paris <|end|>", Split(None, "Paris <|end|>")),  # no header: all content
    (f"{ANALYSIS}a<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{{}}"
     f"<|call|>", Split("a", "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
                            "<|call|>")),  # a message to a function stays whole, for the tool-call parser
    (f"{ANALYSIS}a<|end|>\n<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{{\"x\": 1}}",
     Split("a", "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{\"x\": 1}")),
    ("<|channel|>commentary to=python<|message|>print(1)<|call|>", Split(None, "print(1)")),  # not a function
    (f"{ANALYSIS}a<|end|>{FINAL}", Split("a", "")),
    ("<|chan", Split(None, "<|chan")),  # the end: no header after all
])
def test_a_whole_gpt_oss_output_is_split(text, want):
    assert split_reasoning("gpt_oss", text) == want


@pytest.mark.parametrize("text", [f"{ANALYSIS}a <| b<|end|>{FINAL}yes <|end of it<|return|>",
                                  f"{ANALYSIS}x", "plain <|message|> text",
                                  f"{ANALYSIS}a<|end|><|start|>assistant<|channel|>commentary to=functions.f "
                                  f"<|constrain|>json<|message|>{{\"a\": \"<|\"}}<|call|>"])
def test_every_cut_of_a_gpt_oss_stream_gives_the_whole_split(text):
    want = split_reasoning("gpt_oss", text)
    for size in range(1, len(text) + 1):
        stream = reasoning_stream("gpt_oss")
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        deltas = [stream.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        reasoning, content = "".join(r for r, _ in deltas), "".join(c for _, c in deltas)
        assert (reasoning if stream.has_reasoning else None, content) == (want.reasoning, want.content), size
