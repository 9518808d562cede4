"""Top-p sampling without a sort, for CUDA (Triton): the exponential race restricted to each row's nucleus.

The sorted path (`ops.apply_top_k_top_p_sorted`) sorts every row's whole vocabulary, scatters it back and runs
two softmaxes before the race. Here one program a row streams its logits instead: the race's winner over the
tokens above a pivot, then the probability mass above that winner. The nucleus is the tokens with less than
top_p of mass above them: an upper set in probability order, so if the winner of the whole race lies in it, it
is also the winner of the race inside it (the same token as masking first, with the same noise). If it does
not, neither does any token as likely or less, so the pivot rises to the winner's logit and the race runs
again over the tokens above it. A round fails with probability at most 1 - top_p (two passes a round).
Ties at the nucleus' edge are all kept (the sorted path keeps the ones its sort put first). Off CUDA the kernel
runs through Triton's interpreter (tests only).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

logger = logging.getLogger(__name__)

MAX_ROUNDS = 64  # a row that fails them all (or holds NaN) takes its best token, in every nucleus


@triton.jit
def _nucleus_race_kernel(out_ptr, logits_ptr, noise_ptr, top_p_ptr, floor_ptr, vocab, stride_l, stride_n,
                         HAS_FLOOR: tl.constexpr, MAX_ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_l
    noise_row = noise_ptr + row * stride_n
    top_p = tl.load(top_p_ptr + row)
    neg_inf = float("-inf")
    pivot = tl.full((), neg_inf, tl.float32)  # the race runs over the tokens whose logit is above it
    floor = tl.load(floor_ptr + row) if HAS_FLOOR else neg_inf  # min-p: the race's tokens are at least this
    winner = tl.full((), 0, tl.int32)
    best = tl.full((), 0, tl.int32)  # the row's first most likely token
    is_running = tl.full((), 1, tl.int32)
    mass_above = tl.full((), 0.0, tl.float32)
    num_rounds = 0
    while is_running != 0:
        # The race over the tokens above the pivot: argmax of p / E, E = -log(U), as log p - log E (+ const);
        # the row's max and sum of exp on the way (online softmax), for the mass below.
        row_max = tl.full((), neg_inf, tl.float32)
        row_sum = tl.full((), 0.0, tl.float32)
        best_score = tl.full((), neg_inf, tl.float32)
        best_logit = tl.full((), neg_inf, tl.float32)
        winner = tl.full((), 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            is_col = offs < vocab
            logits = tl.load(logits_row + offs, mask=is_col, other=neg_inf)  # [BLOCK]
            noise = tl.load(noise_row + offs, mask=is_col, other=0.5)  # [BLOCK]
            block_max = tl.max(logits, axis=0)
            if block_max > row_max:
                best = start + tl.argmax(logits, axis=0)
            new_max = tl.maximum(row_max, block_max)
            shift = tl.where(new_max == neg_inf, 0.0, new_max)  # no -inf - -inf while every token so far is -inf
            row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(logits - shift), axis=0)
            row_max = new_max
            scores = tl.where((logits > pivot) & (logits >= floor), logits - tl.log(-tl.log(noise)), neg_inf)  # [BLOCK]
            block_best = tl.max(scores, axis=0)
            if block_best > best_score:  # strictly: the first of equal scores wins, as argmax's
                at = tl.argmax(scores, axis=0)
                best_score, winner = block_best, start + at
                best_logit = tl.sum(tl.where(tl.arange(0, BLOCK) == at, logits, 0.0), axis=0)
        # In the nucleus when the tokens strictly more likely hold less than top_p (the best one always).
        mass_above = tl.full((), 0.0, tl.float32)
        if top_p < 1.0 and best_score > neg_inf:
            for start in range(0, vocab, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                logits = tl.load(logits_row + offs, mask=offs < vocab, other=neg_inf)
                mass_above += tl.sum(tl.where(logits > best_logit, tl.exp(logits - row_max), 0.0), axis=0)
            mass_above = mass_above / row_sum
        num_rounds += 1
        is_running = ((mass_above >= top_p) & (num_rounds < MAX_ROUNDS)).to(tl.int32)
        pivot = best_logit
    winner = tl.where(mass_above < top_p, winner, best)
    tl.store(out_ptr + row, winner.to(tl.int64))


def nucleus_race(logits: torch.Tensor, noise: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None,
                 block: int = 1024) -> torch.Tensor:
    """One token per row of logits [B, V] float32 (temperature applied, masked tokens -inf) from the distribution
    restricted to the row's top-p nucleus, then to min_p [B] (0.0: off) times its best token's probability, as
    the sorted path filters (the nucleus of the whole distribution), by the exponential race with noise
    U ~ Uniform(0, 1) [B, V] (read only). top_p [B] float32 (1.0: the whole row). Returns [B] int64; no host
    sync."""
    assert logits.shape == noise.shape and logits.stride(1) == 1 and noise.stride(1) == 1, "rows of contiguous columns"
    assert logits.dtype == torch.float32 and noise.dtype == torch.float32 and top_p.shape == logits.shape[:1]
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    # min-p in logits: l >= max + log(min_p); log(0) = -inf keeps every token
    floor = None if min_p is None else logits.amax(dim=-1) + min_p.log()  # [B]
    if num_rows:
        _nucleus_race_kernel[(num_rows,)](out, logits, noise, top_p.contiguous(), floor, vocab, logits.stride(0),
                                          noise.stride(0), HAS_FLOOR=floor is not None, MAX_ROUNDS=MAX_ROUNDS,
                                          BLOCK=block, num_warps=8)
    return out


@functools.cache
def compiles_on(device: torch.device) -> bool:
    """Whether the kernel compiles for this device, tried once on a small row: if this Triton cannot, the sampler
    keeps the sorted path, with a warning, instead of failing every step."""
    try:
        nucleus_race(torch.zeros(1, 8, device=device), torch.full((1, 8), 0.5, device=device),
                     torch.full((1,), 0.5, device=device))
    except CompilationError as e:
        logger.warning("the sort-free top-p kernel does not compile here (%s): top-p sorts the vocabulary", e)
        return False
    return True
