"""A step's token bitmask: filled from the structured requests' matchers, applied to the logits.

Bit t of row r (int32 words, little-endian bits) allows token t at logits row r. Rows of unconstrained
requests are left out of the apply (`indices`), so they sample exactly as they would without the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.model.paged_indices import on_device
from llmserve.structured.matcher import RequestGrammar

# (matchers, bitmask [N, W], rows): fill row rows[i] from matchers[i]
BatchFill = Callable[[list, torch.Tensor, list[int]], None]
# Rows a fill thread takes at least: waking the threads costs about what this many rows' fills do on one
# (docs/benchmarks.md, H200 eighth run).
MIN_ROWS_PER_THREAD = 16


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_one_by_one(matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
    for matcher, row in zip(matchers, rows):
        matcher.fill_next_token_bitmask(bitmask, row)


@dataclass
class StepGrammar:
    """The structured requests that sample in a step (by request id), and the drafts scheduled for every
    request of the step (the scheduler output's own dict: an unconstrained request's drafts take logits
    rows too, so the constrained rows after them move down)."""

    grammars: dict[str, RequestGrammar] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)

    def add(self, req_id: str, grammar: RequestGrammar) -> None:
        self.grammars[req_id] = grammar

    def num_rows(self, sampling_req_ids: list[str]) -> int:
        """Logits rows of the step: one per sampling request plus one per draft."""
        return len(sampling_req_ids) + sum(len(self.drafts.get(r, ())) for r in sampling_req_ids)

    def fill(self, sampling_req_ids: list[str], vocab_size: int, bitmask: torch.Tensor | None = None,
             batch_fill: BatchFill = fill_one_by_one) -> tuple[torch.Tensor, list[int]]:
        """The bitmask [N, W] int32 over the step's N logits rows (one per sampling request plus one per
        draft, in that order; into `bitmask`, [N, W], when given) and the rows that are constrained; the
        others are left unfilled. Rows that follow plain decoding go to `batch_fill` together."""
        if bitmask is None:
            bitmask = torch.empty(self.num_rows(sampling_req_ids), bitmask_words(vocab_size), dtype=torch.int32)
        indices: list[int] = []
        batch_matchers, batch_rows = [], []
        row = 0
        for req_id in sampling_req_ids:
            drafts = self.drafts.get(req_id, [])
            grammar = self.grammars.get(req_id)
            if grammar is not None:
                if not drafts and grammar.can_fill_in_batch:
                    batch_matchers.append(grammar.matcher)
                    batch_rows.append(row)
                else:
                    grammar.fill_bitmask(bitmask, row, drafts)
                indices.extend(range(row, row + len(drafts) + 1))
            row += len(drafts) + 1
        if batch_matchers:
            batch_fill(batch_matchers, bitmask, batch_rows)
        return bitmask, indices


class BitmaskFiller:
    """The runner's bitmask buffers and fill threads.

    Rows that follow plain decoding fill in one xgrammar batch call over up to `num_threads` threads on CUDA, at
    least MIN_ROWS_PER_THREAD rows each (a row inside a `pattern` string costs hundreds of microseconds: a
    1,024-row step on one thread would stall the device); drafts and thinking rows fill row by row. On
    CUDA the bitmask lands in one of two reused pinned buffers, copied to the device without the host
    waiting: a buffer is filled again two steps later, once its copy is known done (an event), so no step
    allocates or pins its bitmask.
    """

    def __init__(self, vocab_size: int, device: torch.device, num_threads: int = 1) -> None:
        """num_threads: xgrammar's fill threads (the runner's: worker/cpu_threads.xgrammar_threads), used on CUDA.
        On CPU the forward's OpenMP threads hold the cores (spinning between regions): a hand-off to other threads
        cost more than it saved at serving batch sizes (docs/benchmarks.md), so one fills there."""
        self.vocab_size = vocab_size
        self.device = device
        self.num_threads = num_threads if device.type == "cuda" else 1
        self.is_pinned = device.type == "cuda"
        self.buffers: list[torch.Tensor] = [torch.empty(0, bitmask_words(vocab_size), dtype=torch.int32)] * 2
        self.copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy to the device
        self.slot = 1  # the buffer of the last fill
        self._batches: dict[int, object] = {}  # xgrammar's BatchGrammarMatcher by thread count, made when first used

    def fill(self, grammar: StepGrammar, sampling_req_ids: list[str]) -> tuple[torch.Tensor, list[int]]:
        """The step's bitmask [N, W] (a view of a reused buffer) and its constrained rows."""
        slot = self.slot = 1 - self.slot
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # the copy of two steps ago: long done
            self.copied[slot] = None
        num_rows = grammar.num_rows(sampling_req_ids)
        if self.buffers[slot].shape[0] < num_rows:
            self.buffers[slot] = torch.empty(max(num_rows, 2 * self.buffers[slot].shape[0]),
                                             bitmask_words(self.vocab_size), dtype=torch.int32,
                                             pin_memory=self.is_pinned)
        return grammar.fill(sampling_req_ids, self.vocab_size, self.buffers[slot][:num_rows], self._batch_fill)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
        """apply_bitmask, the buffer's copy to the device noted (fill waits for it two steps later)."""
        apply_bitmask(logits, bitmask, indices)
        if self.is_pinned and indices:
            event = torch.cuda.Event()
            event.record()
            self.copied[self.slot] = event

    def _batch_fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        num_threads = min(self.num_threads, len(rows) // MIN_ROWS_PER_THREAD)
        if num_threads <= 1:
            fill_one_by_one(matchers, bitmask, rows)
            return
        if num_threads not in self._batches:
            import xgrammar as xgr

            self._batches[num_threads] = xgr.BatchGrammarMatcher(num_threads)
        self._batches[num_threads].batch_fill_next_token_bitmask(matchers, bitmask, rows)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Set the disallowed tokens of logits rows `indices` to -inf, in place. logits [N, V] float,
    bitmask [N, W] int32 on the host, pinned on CUDA (BitmaskFiller's buffers; rows outside `indices` are not
    read)."""
    if not indices:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)  # its CPU kernel is faster than ours
        return
    device_bitmask = bitmask.to(logits.device, non_blocking=True)  # [N, W]; pinned: the host does not wait
    rows = on_device(np.asarray(indices, np.int32 if logits.is_cuda else np.int64), logits.device)  # [P]
    if logits.is_cuda:
        import xgrammar as xgr

        # xgrammar's Triton kernel: one pass over the rows (the unpacked [P, V] mask below is 4 bytes a logit)
        xgr.apply_token_bitmask_inplace(logits, device_bitmask, indices=rows, vocab_size=logits.shape[-1],
                                        backend="triton")
        return
    allowed = unpack_bitmask(device_bitmask[rows], logits.shape[-1])  # [P, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [P, W] int32 -> allowed [P, V] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [P, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
