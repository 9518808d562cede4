"""Reasoning output (`--reasoning-parser`, vLLM's names): a thinking model's thoughts, written between
<think> and </think>, are returned apart from its answer (chat's `reasoning_content`, the Responses API's
reasoning item) instead of inside `content`.

- deepseek_r1: the chat template opens <think> itself (DeepSeek-R1), so the output starts in thought and
  everything up to </think> is reasoning; an output that never closes it is all reasoning.
- qwen3: the model writes <think> itself (Qwen3, QwQ); an output that does not begin with it has no
  reasoning (thinking turned off, e.g. `chat_template_kwargs: {"enable_thinking": false}`).
- gpt_oss: OpenAI's harmony format (gpt-oss), read from the output's text with its special tokens (the chat
  route keeps them for this parser). The output is a run of messages, each a header then a body:
    <|channel|>analysis<|message|>THOUGHTS<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
  A body runs from <|message|> to <|end|>, <|return|>, <|call|> or <|endoftext|>; the analysis channel's
  bodies are the reasoning, the others' (final, commentary) the content. An output that opens with no header
  is all content. A message to a function (`<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>`) stays whole in the content, header and markers, for the `openai` tool-call
  parser to read (tool_parsers/harmony.py).

Tool calls and the answer are read from what follows the thoughts.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output had no thoughts
    content: str


def starts_in_thought(parser: str) -> bool:
    return parser == "deepseek_r1"


def needs_special_tokens(parser: str | None) -> bool:
    """Whether the parser reads markers that are special tokens (decoded only when asked for)."""
    return parser == "gpt_oss"


def reasoning_stream(parser: str) -> ThoughtStream:
    """The parser's stream: fed an output's text deltas, it gives (reasoning delta, content delta)."""
    return HarmonyStream() if parser == "gpt_oss" else ReasoningStream(parser)


def split_reasoning(parser: str, text: str) -> Split:
    """A whole output -> its reasoning and its content."""
    stream = reasoning_stream(parser)
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


MESSAGE, CHANNEL, START = "<|message|>", "<|channel|>", "<|start|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")  # the last three: gpt-oss's EOS ids
REASONING_CHANNEL = "analysis"
FUNCTION_RECIPIENT = "to=functions."


class HarmonyStream:
    """An output's text deltas -> (reasoning delta, content delta), as ReasoningStream; a marker cut between
    two deltas is held back until the next one says what it is."""

    def __init__(self) -> None:
        self.state = "start"  # start | header | body | plain
        self.has_reasoning = False
        self.is_reasoning_body = False
        self.is_call_body = False  # a message to a function: passed on whole, as the content
        self.pending = ""  # held back: a header so far, or a possible start of a marker

    def feed(self, text: str, is_final: bool) -> tuple[str, str]:
        text, self.pending = self.pending + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.state == "start":
                text = self._start(text, is_final)
                if text is None:
                    break
            elif self.state == "plain":
                content.append(text)
                break
            elif self.state == "header":
                text = self._header(text, content)
                if text is None:
                    break
            else:
                text = self._body(text, is_final, reasoning if self.is_reasoning_body else content)
        return "".join(reasoning), "".join(content)

    def _start(self, text: str, is_final: bool) -> str | None:
        """At the output's start: a header opens (harmony), or it is plain content; None: wait for more text."""
        stripped = text.lstrip()
        if stripped.startswith((CHANNEL, START)):
            self.state = "header"
            return stripped
        if not is_final and (CHANNEL.startswith(stripped) or START.startswith(stripped)):
            self.pending = text
            return None
        self.state = "plain"
        return text

    def _header(self, text: str, content: list[str]) -> str | None:
        """Up to <|message|>: the body's channel read from it (a call's header goes to `content`); None: the
        header goes on in the next delta."""
        end = text.find(MESSAGE)
        if end < 0:
            self.pending = text
            return None
        header = text[:end]
        self.is_reasoning_body = _channel(header) == REASONING_CHANNEL
        self.is_call_body = not self.is_reasoning_body and function_name(header) is not None
        if self.is_call_body:
            content.append(header.lstrip() + MESSAGE)
        self.has_reasoning |= self.is_reasoning_body
        self.state = "body"
        return text[end + len(MESSAGE):]

    def _body(self, text: str, is_final: bool, out: list[str]) -> str:
        """Body text into `out` up to its end marker (then a header follows); what is left of `text`."""
        ends = [(i, marker) for marker in BODY_ENDS if (i := text.find(marker)) >= 0]
        if ends:
            i, marker = min(ends)
            out.append(text[:i] + (marker if self.is_call_body else ""))
            self.state = "header"
            return text[i + len(marker):]
        keep = 0 if is_final else max(_partial_suffix(text, marker) for marker in BODY_ENDS)
        out.append(text[:len(text) - keep])
        self.pending = text[len(text) - keep:]
        return ""


def function_name(header: str) -> str | None:
    """The function a message header addresses (`... to=functions.NAME ...`), or None (no recipient, or a
    built-in tool's such as `python`)."""
    at = header.find(FUNCTION_RECIPIENT)
    if at < 0:
        return None
    name = header[at + len(FUNCTION_RECIPIENT):].split("<|", 1)[0].split(None, 1)
    return name[0] if name else None


def _channel(header: str) -> str:
    """The channel a header names (`<|start|>assistant<|channel|>final`, or `... to=functions.f <|constrain|>json`)."""
    at = header.find(CHANNEL)
    if at < 0:
        return ""
    rest = header[at + len(CHANNEL):]
    return rest.split("<|", 1)[0].split(None, 1)[0] if rest.strip() else ""


ThoughtStream = ReasoningStream | HarmonyStream  # what reasoning_stream gives
