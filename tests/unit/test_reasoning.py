"""server/reasoning.py: thoughts apart from the answer, whole or streamed in any cut."""

from __future__ import annotations

import pytest

from llmserve.server.reasoning import ReasoningStream, Split, split_reasoning


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
