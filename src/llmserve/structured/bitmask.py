"""A step's token bitmask: filled from the structured requests' matchers, applied to the logits.

Bit t of row r (int32 words, little-endian bits) allows token t at logits row r. Rows of unconstrained
requests are left out of the apply (`indices`), so they sample exactly as they would without the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.model.paged_indices import on_device
from llmserve.structured.matcher import RequestGrammar


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass
class StepGrammar:
    """The structured requests that sample in a step (by request id), with the drafts scheduled for each."""

    grammars: dict[str, RequestGrammar] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)

    def add(self, req_id: str, grammar: RequestGrammar, drafts: list[int] | None) -> None:
        self.grammars[req_id] = grammar
        if drafts:
            self.drafts[req_id] = drafts

    def fill(self, sampling_req_ids: list[str], vocab_size: int) -> tuple[torch.Tensor, list[int]]:
        """The bitmask [N, W] int32 over the step's N logits rows (one per sampling request plus one per
        draft, in that order) and the rows that are constrained; the others are left unfilled."""
        positions = []  # (request grammar, first logits row, drafts)
        num_rows = 0
        for req_id in sampling_req_ids:
            drafts = self.drafts.get(req_id, [])
            grammar = self.grammars.get(req_id)
            if grammar is not None:
                positions.append((grammar, num_rows, drafts))
            num_rows += len(drafts) + 1
        bitmask = torch.empty(num_rows, bitmask_words(vocab_size), dtype=torch.int32)  # [N, W]
        indices: list[int] = []
        for grammar, first, drafts in positions:
            grammar.fill_bitmask(bitmask, first, drafts)
            indices.extend(range(first, first + len(drafts) + 1))
        return bitmask, indices


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Set the disallowed tokens of logits rows `indices` to -inf, in place. logits [N, V] float,
    bitmask [N, W] int32 on the host (rows outside `indices` are not read)."""
    if not indices:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)  # its CPU kernel is faster than ours
        return
    # through pinned memory on CUDA: a pageable copy would wait for the forward queued before it
    rows = on_device(np.asarray(indices, np.int64), logits.device)  # [P]
    allowed = unpack_bitmask(on_device(bitmask.numpy(), logits.device)[rows], logits.shape[-1])  # [P, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [P, W] int32 -> allowed [P, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [P, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
