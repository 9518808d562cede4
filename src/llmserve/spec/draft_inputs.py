"""A draft model's forward inputs, built from its rows' token lists and block ids (the runner's own steps
gather theirs from its persistent batch, worker/persistent_batch.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve.model.attention import AttentionInputs
from llmserve.model.paged_indices import flat_positions, logits_indices, on_device, slot_mapping


@dataclass
class DraftRow:
    """What prepare_inputs reads of a row, for one draft forward."""

    token_ids: np.ndarray | list[int]  # [L]
    num_computed_tokens: int
    block_ids: list[int]


@dataclass
class DraftInputs:
    """One draft forward's inputs (the runner's own: worker/step_inputs.py, which spec/ does not import)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [N] int64: per sampling row its last k + 1 tokens (k drafts; usually 0)


def first_group_blocks(block_ids: list[int], num_kv_groups: int) -> list[int]:
    """A row's block ids of the first KV cache group (core/kv_cache_groups.py: a row's ids interleave the groups):
    the blocks a draft model's or an EAGLE head's cache uses."""
    return block_ids if num_kv_groups == 1 else block_ids[::num_kv_groups]


def prepare_inputs(states: list, num_scheduled: list[int], block_size: int,
                   device: torch.device, drafts: list[list[int]] | None = None) -> DraftInputs:
    """Flatten the step's rows into token, position, slot and block-table tensors (numpy, no per-token loop).

    `drafts` per row: draft tokens scheduled after the row's real tokens (speculative decoding)."""
    num_rows = len(states)
    num_drafts = np.asarray([len(d) for d in drafts] if drafts else [0] * num_rows, dtype=np.int64)  # [B]
    counts = np.asarray(num_scheduled, dtype=np.int64)  # [B]
    starts = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)  # [B]
    cu, row_of_token, positions = flat_positions(starts, counts)  # [B + 1], [T], [T]
    num_tokens = int(cu[-1])
    input_ids = np.fromiter(_token_slices(states, starts, counts, drafts), dtype=np.int64, count=num_tokens)
    block_table = _block_table(states)  # [B, max_blocks]
    slots = slot_mapping(block_table, row_of_token, positions, block_size)
    seq_lens = starts + counts
    sample_rows = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids) + num_drafts[i]]
    attn = AttentionInputs(
        query_start_loc=on_device(cu.astype(np.int32), device),
        seq_lens=on_device(seq_lens.astype(np.int32), device),
        block_table=on_device(block_table, device),
        slot_mapping=on_device(slots, device),
        query_lens_cpu=counts.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        block_size=block_size,
    )
    return DraftInputs(
        input_ids=on_device(input_ids, device),
        positions=on_device(positions, device),
        attn=attn,
        logits_indices=on_device(logits_indices(cu[1:][sample_rows], num_drafts[sample_rows]), device),
    )


def _token_slices(states: list, starts: np.ndarray, counts: np.ndarray,
                  drafts: list[list[int]] | None):
    for i, (state, start, count) in enumerate(zip(states, starts.tolist(), counts.tolist())):
        tokens = state.token_ids + drafts[i] if drafts and drafts[i] else state.token_ids
        yield from tokens[start:start + count]


def _block_table(states: list) -> np.ndarray:
    max_blocks = max(len(s.block_ids) for s in states)
    table = np.zeros((len(states), max_blocks), dtype=np.int32)  # 0 = the null block
    for i, state in enumerate(states):
        table[i, :len(state.block_ids)] = state.block_ids
    return table
