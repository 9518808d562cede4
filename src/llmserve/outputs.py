"""What the engine's front hands to users: RequestOutput with one CompletionOutput per choice."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenLogprob:
    """One position: the sampled token's logprob and rank, plus the top alternatives (best first)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """State of a request after an engine step. In streaming (delta) mode, `outputs[i].text`
    and `.token_ids` hold only what is new since the last RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # prompt_logprobs=k: per prompt token (None for the first) its logprob given the ones before it.
    # In delta mode only the first output carries them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # --runner pooling: the prompt's pooled vector (float32, little-endian; `embedding` reads it)
    pooled: bytes | None = None

    @property
    def embedding(self) -> list[float]:
        """The pooled vector as floats (a pooling request's final output)."""
        assert self.pooled is not None, "not a pooling request's final output"
        return np.frombuffer(self.pooled, dtype="<f4").tolist()
