"""Reasoning output (`--reasoning-parser`, vLLM's names): a thinking model's thoughts, written between
<think> and </think>, are returned apart from its answer (chat's `reasoning_content`, the Responses API's
reasoning item) instead of inside `content`.

- deepseek_r1: the chat template opens <think> itself (DeepSeek-R1), so the output starts in thought and
  everything up to </think> is reasoning; an output that never closes it is all reasoning.
- qwen3: the model writes <think> itself (Qwen3, QwQ); an output that does not begin with it has no
  reasoning (thinking turned off, e.g. `chat_template_kwargs: {"enable_thinking": false}`).

Tool calls and the answer are read from what follows the thoughts.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output had no thoughts
    content: str


def starts_in_thought(parser: str) -> bool:
    return parser == "deepseek_r1"


def split_reasoning(parser: str, text: str) -> Split:
    """A whole output -> its reasoning and its content."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text, is_final=True)
    return Split(reasoning if stream.has_reasoning else None, content)


class ReasoningStream:
    """An output's text deltas -> (reasoning delta, content delta); a tag cut between two deltas is held
    back until the next one says what it is."""

    def __init__(self, parser: str) -> None:
        self.state = "start"  # start | thinking | answer
        self.without_start_tag = "thinking" if starts_in_thought(parser) else "answer"
        self.has_reasoning = False
        self.is_after_thoughts = False  # the newlines that follow </think> are not the answer's
        self.pending = ""  # text held back: a possible prefix of a tag

    def feed(self, text: str, is_final: bool) -> tuple[str, str]:
        text, self.pending = self.pending + text, ""
        reasoning, content = [], []
        while text:
            if self.state == "answer":
                if self.is_after_thoughts:
                    text = text.lstrip("\n")
                    self.is_after_thoughts = not text
                content.append(text)
                break
            if self.state == "start":
                text = self._start(text, is_final)
                if text is None:
                    return "", ""
                continue
            end = text.find(THINK_END)
            if end >= 0:
                reasoning.append(text[:end])
                text, self.state, self.is_after_thoughts = text[end + len(THINK_END):], "answer", True
                continue
            keep = 0 if is_final else _partial_suffix(text, THINK_END)
            reasoning.append(text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def _start(self, text: str, is_final: bool) -> str | None:
        """At the output's start: past <think> (thinking), or the answer begins; None: wait for more text."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            self.state, self.has_reasoning = "thinking", True
            return stripped[len(THINK_START):]
        if not is_final and THINK_START.startswith(stripped):
            self.pending = text
            return None
        self.state = self.without_start_tag
        self.has_reasoning = self.state == "thinking"
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 when none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
