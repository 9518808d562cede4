"""A forward's inputs as the runner builds them (StepInputBuilder here for a launched step;
worker/decode_window.py for a window's later forwards) and its CUDA graphs replay them
(worker/cuda_graphs.py); the index arithmetic is model/paged_indices.py's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmserve.core.sched_output import SchedulerOutput
from llmserve.model.attention import AttentionInputs
from llmserve.model.paged_indices import logits_indices, on_device
from llmserve.model.quant.token_kinds import StepKinds, TokenKinds, token_kinds
from llmserve.worker.input_batch import CachedRequestState
from llmserve.worker.persistent_batch import PersistentBatch, StepArrays
from llmserve.worker.step_times import StepTimes

if TYPE_CHECKING:
    from llmserve.worker.step_handle import StepHandle


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [N] int64: per sampling row its last k + 1 tokens (k drafts; usually 0)
    sample_rows: list[int]  # [S] row index of each sampling row
    token_kinds: TokenKinds | None = None  # decode and prompt tokens, for FP8 layers on CUDA (else None)
    # KV cache groups (core/kv_cache_groups.py): [G] each group's block table and slots (`attn` is group 0's);
    # None with one group
    attn_groups: list[AttentionInputs] | None = None


class StepInputBuilder:
    """Builds a launched step's StepInputs from the persistent batch: its host arrays (the batch's gather),
    then one copy each to the device; ids still on the device (the step in flight's) are read there."""

    def __init__(self, batch: PersistentBatch, device: torch.device, has_groups: bool,
                 step_kinds: StepKinds | None, times: StepTimes) -> None:
        """has_groups: several KV cache groups, each with its table and slots. step_kinds: FP8 layers on CUDA
        route tokens by kind (model/quant/token_kinds.py). times: counts the inputs read on the device."""
        self.batch, self.device, self.has_groups = batch, device, has_groups
        self.step_kinds, self.times = step_kinds, times

    def build(self, states: list[CachedRequestState], rows: np.ndarray, sched_out: SchedulerOutput,
              finishes_at_once: bool, in_flight: StepHandle | None) -> tuple[StepInputs, np.ndarray]:
        """The step's inputs on the device, and [S] the batch rows of its sampling rows; the rows [B]
        count their scheduled tokens computed (the scheduler rolls rejected drafts back: next step's diff).
        Unless the step finishes at once, the next step's inputs may find its sampled ids on the device."""
        batch, num_rows = self.batch, len(states)
        starts = batch.num_computed[rows]  # [B]
        counts = np.fromiter(sched_out.num_scheduled_tokens.values(), np.int64, count=num_rows)  # [B]
        num_drafts = np.zeros(num_rows, np.int64)  # [B]
        for i, state in enumerate(states if sched_out.scheduled_spec_tokens else ()):
            drafts = sched_out.scheduled_spec_tokens.get(state.req_id)
            if drafts:
                batch.set_drafts(state.row, drafts)
                num_drafts[i] = len(drafts)
        arrays = batch.gather(rows, starts, counts)
        batch.num_computed[rows] = starts + counts
        sample_rows = arrays.sample_rows
        batch_rows = rows[sample_rows]  # [S]
        if not finishes_at_once:
            batch.mark_sampled(batch_rows)
        indices = logits_indices(arrays.query_start_loc[1:][sample_rows].astype(np.int64), num_drafts[sample_rows])
        inputs = self._to_device(arrays, indices, in_flight)
        if self.step_kinds is not None:
            inputs.token_kinds = token_kinds(arrays.positions, batch.num_prompt[rows], counts, self.device)
        return inputs, batch_rows

    def _to_device(self, arrays: StepArrays, sample_indices: np.ndarray, in_flight: StepHandle | None) -> StepInputs:
        device = self.device
        input_ids = on_device(arrays.input_ids, device)
        if len(arrays.pending_tokens):
            self.times.num_device_inputs += len(arrays.pending_tokens)
            sources = on_device(arrays.pending_sources, device)
            input_ids[on_device(arrays.pending_tokens, device)] = in_flight.sampled[sources]
        tables, slots = [arrays.block_table], [arrays.slot_mapping]  # [B, W], [T]
        if self.has_groups:  # one of each a KV cache group, out of [B, G * W] and [G, T]
            tables, slots = self.batch.group_tables(arrays.block_table), list(arrays.slot_mapping)
        attn = AttentionInputs(
            query_start_loc=on_device(arrays.query_start_loc, device),
            seq_lens=on_device(arrays.seq_lens.astype(np.int32), device),
            block_table=on_device(np.ascontiguousarray(tables[0]), device),
            slot_mapping=on_device(slots[0], device),
            query_lens_cpu=[1] * len(arrays.seq_lens) if len(input_ids) == len(arrays.seq_lens)  # one token a row
            else np.diff(arrays.query_start_loc).tolist(),
            seq_lens_cpu=arrays.seq_lens.tolist(),
            block_size=self.batch.block_size,
        )
        inputs = StepInputs(input_ids=input_ids, positions=on_device(arrays.positions, device), attn=attn,
                            logits_indices=on_device(sample_indices, device), sample_rows=arrays.sample_rows.tolist())
        if self.has_groups:
            inputs.attn_groups = [attn] + [
                dataclasses.replace(attn, block_table=on_device(np.ascontiguousarray(table), device),
                                    slot_mapping=on_device(group_slots, device))
                for table, group_slots in zip(tables[1:], slots[1:])]
        return inputs
