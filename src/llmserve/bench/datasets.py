"""Benchmark workloads: random, shared-prefix, sharegpt (a local JSON file) and jsonl (one request per line).

`make_sampler(cfg, endpoint, tokenizer)` returns `sample(num, rng) -> list[BenchRequest]`; file datasets are
parsed once, synthetic ones are drawn from `rng` each call (so each load level gets fresh prompts).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llmserve.bench.config import DatasetConfig
from llmserve.bench.tokens import PromptMaker, Tokenizer

# ShareGPT filter, as vLLM's benchmark applies it: too short to measure, or too long for small models.
MIN_SHAREGPT_LEN = 4
MAX_SHAREGPT_PROMPT_LEN = 1024
MAX_SHAREGPT_TOTAL_LEN = 2048
_HUMAN_ROLES = ("human", "user")
_MODEL_ROLES = ("gpt", "assistant", "chatgpt", "bard", "model")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `prompt` is text, or token ids (completions only)."""

    prompt: str | list[int]
    prompt_len: int  # tokens, before any chat template or BOS the server adds
    output_len: int  # max_tokens
    system: str | None = None  # chat: a system message before the prompt (shared-prefix)
    is_prompt_len_exact: bool = True


Sampler = Callable[[int, np.random.Generator], list[BenchRequest]]


def make_sampler(cfg: DatasetConfig, endpoint: str, tokenizer: Tokenizer | None) -> Sampler:
    maker = PromptMaker(tokenizer, cfg.vocab_size)
    is_text = resolve_prompt_format(cfg.prompt_format, endpoint, tokenizer) == "text"
    if cfg.dataset == "random":
        return lambda num, rng: random_requests(cfg, maker, is_text, num, rng)
    if cfg.dataset == "shared-prefix":
        is_chat = endpoint == "chat"
        return lambda num, rng: shared_prefix_requests(cfg, maker, is_text, is_chat, num, rng)
    assert cfg.dataset_path is not None
    if cfg.dataset == "sharegpt":
        pool = load_sharegpt(cfg.dataset_path, maker, is_text)
        return lambda num, rng: [pool[i] for i in rng.choice(len(pool), size=num, replace=num > len(pool))]
    pool = load_jsonl(cfg.dataset_path, cfg.output_len, maker, is_text)
    return lambda num, rng: [pool[i % len(pool)] for i in range(num)]


def resolve_prompt_format(prompt_format: str, endpoint: str, tokenizer: Tokenizer | None) -> str:
    if prompt_format != "auto":
        return prompt_format
    return "text" if tokenizer is not None or endpoint == "chat" else "ids"


def sample_lengths(length: int, range_ratio: float, num: int, rng: np.random.Generator) -> list[int]:
    """Uniform integers in [length*(1-r), length*(1+r)], at least 1."""
    low = max(1, round(length * (1.0 - range_ratio)))
    high = max(low, round(length * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=num).tolist()


def random_requests(cfg: DatasetConfig, maker: PromptMaker, is_text: bool, num: int,
                    rng: np.random.Generator) -> list[BenchRequest]:
    input_lens = sample_lengths(cfg.input_len, cfg.range_ratio, num, rng)
    output_lens = sample_lengths(cfg.output_len, cfg.range_ratio, num, rng)
    return [_make_request(maker, is_text, n_in, n_out, rng) for n_in, n_out in zip(input_lens, output_lens)]


def _make_request(maker: PromptMaker, is_text: bool, num_tokens: int, output_len: int,
                  rng: np.random.Generator) -> BenchRequest:
    if not is_text:
        return BenchRequest(maker.ids(num_tokens, rng), num_tokens, output_len)
    text = maker.text(num_tokens, rng)
    return BenchRequest(text, maker.count(text), output_len, is_prompt_len_exact=maker.is_exact)


def shared_prefix_requests(cfg: DatasetConfig, maker: PromptMaker, is_text: bool, is_chat: bool, num: int,
                           rng: np.random.Generator) -> list[BenchRequest]:
    """`num_prefixes` distinct prefixes of `prefix_len` tokens, each request one of them + a unique suffix.

    Prefixes are spread evenly over the requests, in a shuffled order. On the chat endpoint the prefix is
    the system message.
    """
    prefixes = [_make_request(maker, is_text, cfg.prefix_len, 0, rng) for _ in range(cfg.num_prefixes)]
    which = rng.permutation(np.arange(num) % cfg.num_prefixes).tolist()
    suffixes = random_requests(cfg, maker, is_text, num, rng)
    return [_join(prefixes[p], s, maker, is_chat) for p, s in zip(which, suffixes)]


def _join(prefix: BenchRequest, suffix: BenchRequest, maker: PromptMaker, is_chat: bool) -> BenchRequest:
    num_tokens = prefix.prompt_len + suffix.prompt_len
    if is_chat:
        assert isinstance(prefix.prompt, str) and isinstance(suffix.prompt, str)
        return BenchRequest(suffix.prompt, num_tokens, suffix.output_len, system=prefix.prompt,
                            is_prompt_len_exact=suffix.is_prompt_len_exact)
    if isinstance(prefix.prompt, list) and isinstance(suffix.prompt, list):
        return BenchRequest(prefix.prompt + suffix.prompt, num_tokens, suffix.output_len)
    text = f"{prefix.prompt}{suffix.prompt}"
    return BenchRequest(text, maker.count(text), suffix.output_len, is_prompt_len_exact=maker.is_exact)


def load_sharegpt(path: str, maker: PromptMaker, is_text: bool) -> list[BenchRequest]:
    """First (human, model) turn pair of each conversation; output_len = the model turn's tokens."""
    with open(path, encoding="utf-8") as f:
        try:
            entries = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON file in ShareGPT format ({e})") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of conversations (ShareGPT format)")
    pool = [r for r in (_sharegpt_request(e, maker, is_text) for e in entries) if r is not None]
    if not pool:
        raise ValueError(f"{path}: no usable conversation (a human turn then a model turn, "
                         f"{MIN_SHAREGPT_LEN} to {MAX_SHAREGPT_PROMPT_LEN} prompt tokens)")
    return pool


def _sharegpt_request(entry: object, maker: PromptMaker, is_text: bool) -> BenchRequest | None:
    turns = (entry.get("conversations") or entry.get("conversation")) if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    (role0, text0), (role1, text1) = (_turn(t) for t in turns[:2])
    if role0 not in _HUMAN_ROLES or role1 not in _MODEL_ROLES or not text0 or not text1:
        return None
    prompt_len, output_len = maker.count(text0), maker.count(text1)
    if not maker.is_exact:  # a byte count; about 4 bytes per token on common BPE vocabularies
        prompt_len, output_len = max(1, prompt_len // 4), max(1, output_len // 4)
    if min(prompt_len, output_len) < MIN_SHAREGPT_LEN or prompt_len > MAX_SHAREGPT_PROMPT_LEN \
            or prompt_len + output_len > MAX_SHAREGPT_TOTAL_LEN:
        return None
    return _text_request(text0, prompt_len, output_len, maker, is_text)


def _turn(turn: object) -> tuple[str, str]:
    if not isinstance(turn, dict):
        return "", ""
    role = turn.get("from", turn.get("role", ""))
    text = turn.get("value", turn.get("content", ""))
    return str(role).lower(), text if isinstance(text, str) else ""


def _text_request(text: str, prompt_len: int, output_len: int, maker: PromptMaker, is_text: bool) -> BenchRequest:
    if is_text:
        return BenchRequest(text, prompt_len, output_len, is_prompt_len_exact=maker.is_exact)
    if maker.tokenizer is None:
        raise ValueError("--prompt-format ids with a text dataset needs --tokenizer")
    ids = maker.tokenizer.encode(text)
    return BenchRequest(ids, len(ids), output_len)


def load_jsonl(path: str, default_output_len: int, maker: PromptMaker, is_text: bool) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": text or token ids, "output_len" (or "max_tokens"): int}."""
    pool = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                pool.append(_jsonl_request(line, f"{path}:{line_no}", default_output_len, maker, is_text))
    if not pool:
        raise ValueError(f"{path}: no requests (expected one JSON object per line)")
    return pool


def _jsonl_request(line: str, where: str, default_output_len: int, maker: PromptMaker,
                   is_text: bool) -> BenchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    output_len = obj.get("output_len", obj.get("max_tokens", default_output_len)) if isinstance(obj, dict) else 0
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"{where}: output_len must be a positive integer, got {output_len!r}")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        return _ids_request(prompt, output_len, where, maker, is_text)
    if isinstance(prompt, str) and prompt:
        return _text_request(prompt, _text_len(prompt, maker), output_len, maker, is_text)
    raise ValueError(f"{where}: expected a \"prompt\": a non-empty string or list of token ids")


def _ids_request(ids: list[int], output_len: int, where: str, maker: PromptMaker, is_text: bool) -> BenchRequest:
    if not is_text:
        return BenchRequest(ids, len(ids), output_len)
    if maker.tokenizer is None:
        raise ValueError(f"{where}: a token-id prompt sent as text (chat or --prompt-format text) needs --tokenizer")
    return BenchRequest(maker.tokenizer.decode(ids), len(ids), output_len)


def _text_len(text: str, maker: PromptMaker) -> int:
    return maker.count(text) if maker.is_exact else max(1, len(text.encode()) // 4)
