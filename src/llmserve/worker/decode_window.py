"""The inputs of a multi-step's later forwards (worker/multi_step.py), built once per window.

After the window's first forward every row's blocks for the whole window are in the persistent batch
(the scheduler allocated them with the step), and forward j of a row computes the token at its first
position + j, whose id the forward before sampled. So each forward's positions and cache slots are
computed for all forwards at once, the block table goes to the device once (again only when rows drop
out), and a forward's inputs are a few views of those arrays plus the ids just sampled: no per-forward
gather over the batch. With KV cache groups (core/kv_cache_groups.py) each group has its table and slots.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.model.attention import AttentionInputs
from llmserve.model.quant.token_kinds import ALL_DECODE
from llmserve.model.step_inputs import StepInputs, on_device, slot_mapping
from llmserve.worker.input_batch import CachedRequestState
from llmserve.worker.persistent_batch import PersistentBatch


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

