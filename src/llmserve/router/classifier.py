"""Model routing by difficulty: a cheap, rule-based classifier for `model: "auto"` requests.

Order of evaluation (first match wins):
1. the configured rules, in order: each names conditions (all must hold) and a pool;
2. prompt longer than `max_small_prompt_chars` -> large pool (reason `prompt_chars`);
3. requested max_tokens above `max_small_max_tokens` -> large pool (reason `max_tokens`);
4. otherwise -> small pool (reason `default`).
Prompt length counts characters of the prompt (chat: every message's text); token-id prompts count
4 characters per token. No model is run: deciding costs microseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmserve.router.policies import RouteRequest


@dataclass(frozen=True)
class DifficultyRule:
    pool: str
    name: str = "rule"
    min_prompt_chars: int | None = None
    max_prompt_chars: int | None = None
    min_max_tokens: int | None = None
    max_max_tokens: int | None = None
    contains: tuple[str, ...] = ()  # any of these substrings (case-insensitive) in the prompt
    regex: str | None = None  # searched in the prompt

    def __post_init__(self) -> None:
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"rule {self.name!r}: bad regex {self.regex!r}: {e}") from None

    def matches(self, request: RouteRequest) -> bool:
        return self._matches_lengths(request) and self._matches_text(request.prompt_text)

    def _matches_lengths(self, request: RouteRequest) -> bool:
        chars, max_tokens = request.num_prompt_chars, request.max_tokens
        return ((self.min_prompt_chars is None or chars >= self.min_prompt_chars)
                and (self.max_prompt_chars is None or chars <= self.max_prompt_chars)
                and (self.min_max_tokens is None or (max_tokens is not None and max_tokens >= self.min_max_tokens))
                and (self.max_max_tokens is None or (max_tokens is not None and max_tokens <= self.max_max_tokens)))

    def _matches_text(self, text: str) -> bool:
        lowered = text.lower()
        if self.contains and not any(s.lower() in lowered for s in self.contains):
            return False
        return self.regex is None or re.search(self.regex, text) is not None


@dataclass(frozen=True)
class AutoRouteConfig:
    model: str = "auto"  # the model name that asks for routing by difficulty
    small_pool: str | None = None
    large_pool: str | None = None
    max_small_prompt_chars: int = 2000
    max_small_max_tokens: int = 512
    rules: tuple[DifficultyRule, ...] = field(default_factory=tuple)

    @property
    def is_enabled(self) -> bool:
        return self.small_pool is not None and self.large_pool is not None


@dataclass(frozen=True)
class RouteDecision:
    pool: str
    reason: str  # the rule's name, or prompt_chars | max_tokens | default


def classify(config: AutoRouteConfig, request: RouteRequest) -> RouteDecision:
    assert config.small_pool is not None and config.large_pool is not None
    for rule in config.rules:
        if rule.matches(request):
            return RouteDecision(rule.pool, rule.name)
    if request.num_prompt_chars > config.max_small_prompt_chars:
        return RouteDecision(config.large_pool, "prompt_chars")
    if request.max_tokens is not None and request.max_tokens > config.max_small_max_tokens:
        return RouteDecision(config.large_pool, "max_tokens")
    return RouteDecision(config.small_pool, "default")
