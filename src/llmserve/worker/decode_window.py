"""Multi-step decoding, the runner's side (the scheduler's: core/decode_window.py): one scheduled step of
up to k forwards of one token a row, and one output of them all.

The first forward is launched like a plain step (it takes in the step's diff: new blocks, finished
requests); the later ones run over a DecodeWindow, each row's input the id the forward before sampled.
After the first forward every row's blocks for the whole window are in the persistent batch (the
scheduler allocated them with the step), and forward j of a row computes the token at its first
position + j. So each forward's positions and cache slots are computed for all forwards at once, the
block table goes to the device once (again only when rows drop out), and a forward's inputs are a few
views of those arrays plus the ids just sampled: no per-forward gather over the batch. With KV cache
groups (core/kv_cache_groups.py) each group has its table and slots.

Row i runs num_scheduled_tokens[i] forwards and drops out after its last. The runner's `WindowEnds` may
end the window after any forward (input came for the engine), or where a row ran its last (an engine
whose outputs are read as they come): each row then reports the ids it got, and the scheduler rolls the
rest of its count back. A row that samples an id it stops on (EOS, a stop id, past min_tokens) runs no
further forward: a window costs no compute past a stop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.model.attention import AttentionInputs
from llmserve.model.paged_indices import on_device, slot_mapping
from llmserve.model.quant.token_kinds import ALL_DECODE
from llmserve.worker.input_batch import CachedRequestState
from llmserve.worker.persistent_batch import PersistentBatch
from llmserve.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from llmserve.worker.model_runner import ModelRunner


@dataclass
class WindowEnds:
    """Where a window may end before its last forward. `has_input`, asked between forwards: True ends the
    window there (input came for the engine: a new request, an abort); None: windows run whole.
    `is_at_first_finish`: the window ends after the forward where some row ran its last."""

    has_input: Callable[[], bool] | None = None
    is_at_first_finish: bool = False

@torch.inference_mode()  # one context for the window's forwards
def run_window(runner: ModelRunner, sched_out: SchedulerOutput) -> ModelRunnerOutput:
    """Per row of the step its sampled ids, one a forward it ran."""
    started = time.perf_counter()
    req_ids = list(sched_out.num_scheduled_tokens)
    counts = np.fromiter(sched_out.num_scheduled_tokens.values(), np.int64, count=len(req_ids))  # [B]
    sampled = np.zeros((sched_out.num_steps, len(req_ids)), np.int64)  # [k, B]
    first = dataclasses.replace(sched_out, num_scheduled_tokens=dict.fromkeys(req_ids, 1),
                                total_num_scheduled_tokens=len(req_ids), num_steps=1)
    ids = sampled[0] = runner.finish_sampled(runner.launch(first, finishes_at_once=True))  # [B]
    states, batch_rows = runner.step_rows(req_ids)  # batch_rows [B]
    window = DecodeWindow(runner.batch, states, batch_rows, sched_out.num_steps, runner.device)
    stop_ids = _stop_ids(states)  # [N] ids some row stops on, or None
    rows = np.arange(len(req_ids))  # [B'] the rows of the next forward
    num_all = int(counts.min())  # forwards that every row runs
    if stop_ids is not None:
        num_all = min(num_all, _end_stopped(ids, stop_ids, rows, states, counts, 1))
    for j in range(1, sched_out.num_steps):
        if _ends_here(runner.window_ends, j >= num_all):
            counts = np.minimum(counts, j)  # [B] the forwards each row ran
            break
        if j >= num_all:  # some row ran its last forward
            is_left = counts[rows] > j  # [B']
            if not is_left.any():
                break  # every row ran its last forward (rows stopped early)
            if not is_left.all():  # some rows ran their last forward
                kept = np.flatnonzero(is_left)
                rows, ids = rows[kept], ids[kept]
                window.keep(kept)
        started = time.perf_counter()
        ids = sampled[j, rows] = runner.decode_forward(window.inputs(j, ids), window.batch_rows, window.states,
                                                       started)  # [B']
        window.append(ids)
        if stop_ids is not None:
            num_all = min(num_all, _end_stopped(ids, stop_ids, rows, window.states, counts, j + 1))
    token_ids = sampled.T.tolist()
    for i in np.flatnonzero(counts < sampled.shape[0]).tolist():
        del token_ids[i][counts[i]:]
    if runner.speculator is not None and counts.min() == counts.max():  # every row ran every forward
        runner.speculator.observe_window(len(req_ids), int(counts[0]), time.perf_counter() - started)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=token_ids)


def _ends_here(ends: WindowEnds, has_row_finished: bool) -> bool:
    """Whether the window ends before its next forward (`has_row_finished`: some row ran its last)."""
    return (has_row_finished and ends.is_at_first_finish) or (ends.has_input is not None and ends.has_input())


def _stop_ids(states: list[CachedRequestState]) -> np.ndarray | None:
    """[N] the ids that end some row of the window (EOS unless ignored, stop_token_ids), or None if none do."""
    ids = {token_id for state in states for token_id in state.stop_token_ids_for_min_tokens}
    return np.fromiter(ids, np.int64, count=len(ids)) if ids else None


def _end_stopped(ids: np.ndarray, stop_ids: np.ndarray, rows: np.ndarray, states: list[CachedRequestState],
                 counts: np.ndarray, num_ran: int) -> int:
    """Rows [B'] whose id [B'] of the forward just run ends them (a stop id, past min_tokens) run no more
    forwards: their counts [B] become `num_ran` (the scheduler stops them at that id). Returns the
    smallest count now."""
    for i in np.flatnonzero(np.isin(ids, stop_ids)).tolist():
        state = states[i]
        if int(ids[i]) in state.stop_token_ids_for_min_tokens and state.num_output_tokens >= state.params.min_tokens:
            counts[rows[i]] = num_ran
    return int(counts.min())


class DecodeWindow:
    """The rows still running in a window: their batch rows [B] and states, and per forward j the
    positions and cache slots of all the window's rows ([k, B0]); `keep` drops rows that ran their last
    forward (`columns` [B] picks the rest out of the B0 they started as)."""

    def __init__(self, batch: PersistentBatch, states: list[CachedRequestState], batch_rows: np.ndarray,
                 num_forwards: int, device: torch.device) -> None:
        self.batch, self.device = batch, device
        firsts = batch.num_computed[batch_rows] - 1  # [B0] each row's position in the window's first forward
        self.positions = firsts[None, :] + np.arange(num_forwards)[:, None]  # [k, B0]
        # room for every id it samples (a row's last id goes at most right after the context's last token)
        batch.ensure_token_columns(min(int(firsts.max()) + num_forwards, batch.max_model_len) + 1)
        block_table = batch.rows_block_table(batch_rows)  # [B0, G * W]
        # a row's forwards past its count would index past its blocks: clipped (they never run)
        last_slot = block_table.shape[1] // batch.num_groups * batch.block_size - 1
        self.slots = [slot_mapping(table, np.arange(len(batch_rows))[None, :], np.minimum(self.positions, last_slot),
                                   batch.block_size) for table in batch.group_tables(block_table)]  # [G] x [k, B0]
        self._arange = on_device(np.arange(len(batch_rows) + 1, dtype=np.int64), device)  # [B0 + 1]
        self._arange_int32 = self._arange.int()  # [B0 + 1]
        self._all_rows = list(range(len(batch_rows)))
        self._all_states = np.empty(len(states), dtype=object)  # [B0]
        self._all_states[:] = states
        self.columns: np.ndarray | None = None  # None: all B0 rows
        self._states: list[CachedRequestState] | None = states
        self._seq_lens = firsts + 1  # [B] the last forward's (`inputs` sets it)
        self._set_rows(batch_rows, block_table)

    def _set_rows(self, batch_rows: np.ndarray, block_table: np.ndarray) -> None:
        num_rows = len(batch_rows)
        self.batch_rows, self.block_table = batch_rows, block_table  # [B], [B, G * W]
        self.group_tables = [on_device(np.ascontiguousarray(table), self.device)
                             for table in self.batch.group_tables(block_table)]  # [G] x [B, W]
        self.query_start_loc = self._arange_int32[:num_rows + 1]  # [B + 1]
        self.logits_indices = self._arange[:num_rows]  # [B]
        self.sample_rows = self._all_rows[:num_rows]

    @property
    def states(self) -> list[CachedRequestState]:
        """The rows' states (listed when asked: plain greedy sampling never asks)."""
        if self._states is None:
            self._states = self._all_states[self.columns].tolist()
        return self._states

    def keep(self, kept: np.ndarray) -> None:
        """Only rows `kept` [B'] (indices into the current rows, in order) run the later forwards."""
        self.columns = kept if self.columns is None else self.columns[kept]
        self._states = None
        self._set_rows(self.batch_rows[kept], self.block_table[kept])

    def inputs(self, j: int, input_ids: np.ndarray) -> StepInputs:
        """Forward j's inputs: each row's token `input_ids` [B] (sampled by forward j - 1) at its position;
        the rows count it computed."""
        positions, slots = self.positions[j], [group_slots[j] for group_slots in self.slots]  # [B0], [G] x [B0]
        if self.columns is not None:
            positions, slots = positions[self.columns], [group_slots[self.columns] for group_slots in slots]  # [B]
        seq_lens = self._seq_lens = positions + 1
        self.batch.num_computed[self.batch_rows] = seq_lens
        seq_lens_device = on_device(seq_lens.astype(np.int32), self.device)
        attn = [AttentionInputs(
            query_start_loc=self.query_start_loc, seq_lens=seq_lens_device, block_table=table,
            slot_mapping=on_device(group_slots, self.device), query_lens_cpu=[1] * len(positions),
            seq_lens_cpu=seq_lens.tolist(), block_size=self.batch.block_size)
            for table, group_slots in zip(self.group_tables, slots)]
        return StepInputs(input_ids=on_device(input_ids, self.device), positions=on_device(positions, self.device),
                          attn=attn[0], logits_indices=self.logits_indices, sample_rows=self.sample_rows,
                          token_kinds=ALL_DECODE, attn_groups=attn if len(attn) > 1 else None)

    def append(self, token_ids: np.ndarray) -> None:
        """The forward `inputs` was last called for sampled `token_ids` [B]: each row's next id, after the
        token at its position."""
        self.batch.token_ids[self.batch_rows, self._seq_lens] = token_ids
        self.batch.num_tokens[self.batch_rows] = self._seq_lens + 1

