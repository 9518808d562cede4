"""Incremental detokenization: token ids in, newly final text out, O(new tokens) per call.

The prefix_offset / read_offset scheme of HF TGI and vLLM: keep a short window of ids, decode
"context + new" and "context" and emit the difference. Text ending in U+FFFD (a UTF-8 character
whose bytes have not all arrived) is held back until the next token completes it. If the window
still ends in U+FFFD after several tokens (invalid bytes, not a partial character), its stable
part is emitted so the window stays short.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Protocol

NUM_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output tokens
MAX_PENDING_TOKENS = 6  # held-back tokens before we look for a stable prefix to emit
_NUM_UNSTABLE_TAIL_TOKENS = 3  # a partial UTF-8 character (<= 3 bytes) lies within these
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text, a few tokens at a time.

    `add()` returns the newly final text; `flush()` returns what was held back (call it when the
    sequence finishes); `output_text` is everything returned so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._decode_ids = decode_function(tokenizer, skip_special_tokens)
        # ids[prefix_offset:]; the first `_num_read` of them are context whose text was emitted.
        self._window: list[int] = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self._num_read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._output_text = ""

    @property
    def output_text(self) -> str:
        return self._output_text

    def add(self, new_token_ids: list[int]) -> str:
        """Append generated ids; return the text they finalize ("" while a character is incomplete)."""
        if not new_token_ids:
            return ""
        self._window.extend(new_token_ids)
        text = self._decode(self._window)
        if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
            return self._emit(text, len(self._window))
        if len(new_token_ids) > 1:  # the last character is incomplete: emit what the others finish
            del self._window[-len(new_token_ids):]
            return "".join(self.add([token_id]) for token_id in new_token_ids)
        if len(self._window) - self._num_read > MAX_PENDING_TOKENS:
            return self._emit_stable_part(text)
        return ""

    def decode_all(self, token_ids: list[int]) -> str:
        """The text of all a finished sequence's ids in one decode (for a sequence nothing was added to;
        what add(token_ids) + flush() returns, without add's token-by-token retreat when the text ends in
        an incomplete character)."""
        assert not self._output_text and self._num_read == len(self._window), "ids were added already"
        self._output_text = self._decode(self._window + token_ids)[len(self._prefix_text):] if token_ids else ""
        return self._output_text

    def flush(self) -> str:
        """Return the held-back text as it decodes now, U+FFFD included (the sequence is over)."""
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text, len(self._window))

    def _emit(self, text: str, end: int) -> str:
        """`text` decodes window[:end]: emit its new part; window[num_read:end] becomes the context."""
        new_text = text[len(self._prefix_text):]
        self._window = self._window[self._num_read:]
        self._num_read = end - self._num_read
        self._prefix_text = self._decode(self._window[:self._num_read])
        self._output_text += new_text
        return new_text

    def _emit_stable_part(self, text: str) -> str:
        """Emit window[:cut] if no later byte can change its text: decoding it apart from the
        rest gives the same text as decoding everything (so no character spans the cut)."""
        cut = len(self._window) - _NUM_UNSTABLE_TAIL_TOKENS
        head_text = self._decode(self._window[:cut])
        if len(head_text) <= len(self._prefix_text):
            return ""
        if head_text + self._decode(self._window[cut:]) != text:
            return ""
        return self._emit(head_text, cut)

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._decode_ids(token_ids)


def decode_function(tokenizer: Tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text as tokenizer.decode gives it. A transformers fast tokenizer that cleans up no spaces
    adds nothing to its Rust backend's decode but per-call conversions (two thirds of the call for a
    few ids, twice a token: docs/benchmarks.md), so the backend is called directly then."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return partial(backend.decode, skip_special_tokens=skip_special_tokens)
