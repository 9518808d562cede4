"""Which kernel each token row of a forward takes through an FP8 linear layer on CUDA.

A token is a decode token when its position is past its sequence's prompt: an output token fed back, a draft,
or an output recomputed after preemption; every other token is a prompt token. Decode tokens go through
fp8_triton.fp8_decode_matmul, whose sums for a row do not depend on the other rows; prompt tokens through
`torch._scaled_mm`, fast on many rows. Deciding by position, never by the step's size or make-up, keeps
each token of a sequence on the same kernel in every batch, which is what keeps greedy outputs independent
of the batch (and a verification's rows the same as plain decoding's).

The runner says what the forward under way holds (`StepKinds.using`) and every Fp8Linear of the model reads
it; CUDA graphs of decode steps are captured with every row a decode row (worker/cuda_graphs.py). Outside
`using` every row is a prompt row: forwards that nobody describes (a draft model's) keep `_scaled_mm`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TokenKinds:
    """A forward's tokens [T] by kind: all decode, all prompt, or both. A step with both usually has its
    decode tokens first (the scheduler puts running rows before new prompts): then tokens [0, D) are
    decode and [D, T) prompt, and the layers take slices (no gather of the prompt's rows, no scatter of
    their outputs); in any other order, two index sets."""

    is_all_decode: bool
    num_leading_decode: int = 0  # > 0: a mixed step whose tokens [0, this) are its decode tokens
    decode_index: torch.Tensor | None = None  # [D] int64 token indices, a mixed step in any other order
    prompt_index: torch.Tensor | None = None  # [P] int64, T = D + P

    @property
    def is_mixed(self) -> bool:
        return self.num_leading_decode > 0 or self.decode_index is not None


ALL_DECODE = TokenKinds(is_all_decode=True)
ALL_PROMPT = TokenKinds(is_all_decode=False)


def token_kinds(positions: np.ndarray, prompt_lens: np.ndarray, counts: np.ndarray,
                device: torch.device) -> TokenKinds:
    """positions [T] int64 of a step whose rows [B] hold counts [B] tokens each, prompt_lens [B] -> kinds."""
    if len(positions) == len(counts):  # one token a row: compare the rows directly
        is_decode = positions >= prompt_lens  # [T]
    else:
        is_decode = positions >= np.repeat(prompt_lens, counts)  # [T]
    if is_decode.all():
        return ALL_DECODE
    if not is_decode.any():
        return ALL_PROMPT
    decode = np.flatnonzero(is_decode)
    if decode[-1] == len(decode) - 1:  # decode tokens first
        return TokenKinds(False, num_leading_decode=len(decode))
    prompt = np.flatnonzero(~is_decode)
    return TokenKinds(False, decode_index=torch.from_numpy(decode).to(device),
                      prompt_index=torch.from_numpy(prompt).to(device))


class StepKinds:
    """The kinds of the forward under way, shared by a model's FP8 layers (model/quant quantize_model)."""

    def __init__(self) -> None:
        self.current = ALL_PROMPT

    @contextmanager
    def using(self, kinds: TokenKinds) -> Iterator[None]:
        assert self.current is ALL_PROMPT, "forwards of one model do not nest"
        self.current = kinds
        try:
            yield
        finally:
            self.current = ALL_PROMPT


def step_kinds_of(model: torch.nn.Module) -> StepKinds | None:
    """The model's StepKinds when it has FP8 layers, else None (nothing to route)."""
    return getattr(model, "step_kinds", None)
