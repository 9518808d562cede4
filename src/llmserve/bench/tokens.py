"""Prompt tokens for the benchmark datasets: random token ids, and text of an exact token count."""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

_TEXT_ALPHABET = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
_MAX_FIX_STEPS = 8
_MIN_CLEAN_IDS = 16  # fewer ids survive the round trip: use all non-special ids


class Tokenizer(Protocol):
    """What the datasets need of a tokenizer (no special tokens added or decoded)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def clean_ids(self) -> np.ndarray:
        """Token ids that are not special and that decode and re-encode to themselves."""
        ...


class FastTokenizer:
    """A `tokenizers` tokenizer.json (fast to load, no transformers import)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def clean_ids(self) -> np.ndarray:
        special = set(self._tok.get_added_tokens_decoder())
        ids = [i for i in range(self._tok.get_vocab_size(with_added_tokens=True)) if i not in special]
        texts = self._tok.decode_batch([[i] for i in ids], skip_special_tokens=True)
        encoded = self._tok.encode_batch(texts, add_special_tokens=False)
        clean = [i for i, text, enc in zip(ids, texts, encoded) if text.strip() and enc.ids == [i]]
        return np.array(clean if len(clean) >= _MIN_CLEAN_IDS else ids, dtype=np.int64)


class TransformersTokenizer:
    """Any tokenizer AutoTokenizer can load (used when there is no tokenizer.json)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def clean_ids(self) -> np.ndarray:
        special = set(self._tok.all_special_ids)
        return _round_trip_ids(self, [i for i in range(len(self._tok)) if i not in special])


def load_tokenizer(path: str) -> Tokenizer:
    """A HF tokenizer directory (or a tokenizer.json file)."""
    if not os.path.exists(path):
        raise ValueError(f"--tokenizer: {path!r} does not exist")
    json_path = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
    if os.path.isfile(json_path):
        return FastTokenizer(json_path)
    return TransformersTokenizer(path)


def _round_trip_ids(tok: Tokenizer, ids: list[int]) -> np.ndarray:
    clean = [i for i in ids if (text := tok.decode([i])).strip() and tok.encode(text) == [i]]
    return np.array(clean if len(clean) >= _MIN_CLEAN_IDS else ids, dtype=np.int64)


class PromptMaker:
    """Makes prompts of a given token count: token ids, or text whose token count is right.

    Without a tokenizer, ids are drawn below `vocab_size`, and text is random letters (one byte each,
    so about one token each on a byte-level vocabulary: the count is then an estimate).
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int):
        self.tokenizer = tokenizer
        self._ids = tokenizer.clean_ids() if tokenizer else np.arange(vocab_size, dtype=np.int64)

    @property
    def is_exact(self) -> bool:
        return self.tokenizer is not None

    def ids(self, num_tokens: int, rng: np.random.Generator) -> list[int]:
        return self._ids[rng.integers(0, len(self._ids), size=num_tokens)].tolist()

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        if self.tokenizer is None:
            return "".join(_TEXT_ALPHABET[rng.integers(0, len(_TEXT_ALPHABET), size=num_tokens)])
        return self._fit_text(self.ids(num_tokens, rng), num_tokens, rng)

    def count(self, text: str) -> int:
        """Tokens of `text` (a byte count without a tokenizer)."""
        return len(self.tokenizer.encode(text)) if self.tokenizer else len(text.encode())

    def _fit_text(self, ids: list[int], num_tokens: int, rng: np.random.Generator) -> str:
        """Decode, re-encode, then cut or pad the ids until the text re-encodes to `num_tokens`."""
        assert self.tokenizer is not None
        text = self.tokenizer.decode(ids)
        for _ in range(_MAX_FIX_STEPS):
            got = self.tokenizer.encode(text)
            if len(got) == num_tokens:
                break
            ids = got[:num_tokens] if len(got) > num_tokens else got + self.ids(num_tokens - len(got), rng)
            text = self.tokenizer.decode(ids)
        return text
