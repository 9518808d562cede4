"""A draft model's later forwards for plain greedy rows, kept on the device.

A proposal's first draft forward catches the draft up on the real tokens (one or more a row); each of
its k - 1 later forwards feeds every row the draft the forward before chose, one token a row. When
every row takes the argmax of the raw logits (plain greedy: no penalties, bias or min_tokens), those
forwards need nothing from the host: a forward's input ids are the previous forward's argmax, its
positions and cache slots follow from the rows' lengths and block tables (sent once), and the k drafts
come to the host once, at the end. The forwards run through the draft's decode CUDA graphs
(worker.cuda_graphs): no host round trip and no kernel launches of their own between the k forwards.

`run_after_verify` also keeps the first forward on the device, straight after a verification step whose
rows each carried k drafts: the target's argmaxes are still on the device, and so are the verified
tokens and their positions. Each row's accepted count comes from comparing them there; the catch-up
forward then feeds the draft the verification's k + 1 tokens plus one, with the token after the accepted
drafts replaced by the target's own (the bonus token), through the draft's graphs of k + 2 queries a
row, and the first draft is the argmax at the bonus token. Only its first accepted + 2 positions hold
real tokens: the KV written past them is rewritten before any forward reads it (the chain writes the
next positions in order, and the next catch-up starts at the next verification's first token). So the
next step's drafts are queued behind the verification with no host round trip between them, and the
host waits on the device once for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from llmserve.model.paged_indices import slot_mapping
from llmserve.spec.draft_head import DraftHead


class DecodeForward(Protocol):
    """The draft model's decode forward over persistent buffers (worker.cuda_graphs.DecodeGraphs; spec/
    may not import worker/, which holds the speculator)."""

    def fits(self, num_rows: int, num_block_columns: int) -> bool: ...

    def run_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class VerifiedStep:
    """A verification step on the device: B rows of k + 1 tokens each (the last real token, k drafts)."""

    input_ids: torch.Tensor  # [B * (k + 1)] int64
    positions: torch.Tensor  # [B * (k + 1)] int64, consecutive within a row
    block_table: torch.Tensor  # [B, W] int32, covering positions up to the first + 2k
    target: torch.Tensor | None = None  # [B * (k + 1)] int64: the target's argmax at each position


class DraftChain:
    def __init__(self, head: DraftHead, graphs: DecodeForward, block_size: int,
                 device: torch.device, catch_up: DecodeForward | None = None) -> None:
        self.head = head  # the draft model's logits (spec/draft_head.py)
        self.graphs = graphs  # the draft model's decode graphs (or their eager buffers: use_graphs=False)
        self.catch_up = catch_up  # its graphs of k + 2 queries a row (run_after_verify), if captured
        self.block_size = block_size
        self.device = device

    def fits(self, num_rows: int, num_block_columns: int) -> bool:
        return self.graphs.fits(num_rows, num_block_columns)

    def fits_after_verify(self, num_rows: int, num_block_columns: int) -> bool:
        return self.catch_up is not None and self.catch_up.fits(num_rows, num_block_columns) and \
            self.fits(num_rows, num_block_columns)

    @torch.inference_mode()
    def run_after_verify(self, step: VerifiedStep, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next drafts [B, k] and the rows' new lengths [B] (real tokens after the step), on the device."""
        num_rows = step.block_table.shape[0]
        ids = step.input_ids.view(num_rows, k + 1)  # [B, k + 1]
        target = step.target.view(num_rows, k + 1)  # [B, k + 1]
        first_position = step.positions.view(num_rows, k + 1)[:, 0]  # [B]
        num_accepted = (ids[:, 1:] == target[:, :k]).long().cumprod(dim=1).sum(dim=1)  # [B]
        bonus_at = (num_accepted + 1).unsqueeze(1)  # [B, 1]: the token after the accepted drafts
        tokens = torch.cat([ids, ids[:, :1]], dim=1).scatter_(1, bonus_at, target.gather(1, bonus_at - 1))  # [B, k+2]
        positions = (first_position.unsqueeze(1) + torch.arange(k + 2, device=self.device)).flatten()  # [B * (k+2)]
        rows = torch.arange(num_rows, device=self.device)  # [B]
        slots = slot_mapping(step.block_table, rows.repeat_interleave(k + 2), positions, self.block_size)
        hidden = self.catch_up.run_rows(tokens.flatten(), positions, slots, (first_position + k + 2).int(),
                                        step.block_table)  # [B * (k + 2), H]
        at_bonus = hidden.view(num_rows, k + 2, -1)[rows, bonus_at.squeeze(1)]  # [B, H]
        first = self.head.argmax(at_bonus)  # [B]
        lengths = first_position + num_accepted + 2  # [B]
        return self._chain(first, lengths, step.block_table, k), lengths

    @torch.inference_mode()
    def run(self, first: torch.Tensor, lengths: np.ndarray, table: torch.Tensor, k: int) -> torch.Tensor:
        """first [B] int64 on the device: each row's first draft (sampled at its last real token);
        lengths [B] on the host: the rows' real tokens (the first draft's position); table [B, W] int32 on
        the device, the rows' blocks (covering positions up to lengths + k - 2). Returns the drafts [B, k]
        on the device: first, then k - 1 argmaxes, forward i feeding draft i - 1 at position
        lengths + i - 1."""
        start = torch.from_numpy(lengths.astype(np.int64)).to(self.device, non_blocking=True)  # [B]
        return self._chain(first, start, table, k)

    def _chain(self, first: torch.Tensor, start: torch.Tensor, table: torch.Tensor, k: int) -> torch.Tensor:
        """run's forwards, `start` [B] on the device."""
        rows = torch.arange(len(start), device=self.device)  # [B]
        drafts = [first]
        for i in range(1, k):
            positions = start + (i - 1)  # [B]
            slots = slot_mapping(table, rows, positions, self.block_size)  # [B]
            hidden = self.graphs.run_rows(drafts[-1], positions, slots, (positions + 1).int(), table)  # [B, H]
            drafts.append(self.head.argmax(hidden))  # [B]
        return torch.stack(drafts, dim=1)  # [B, k]
