"""Per-request state the model runner keeps across steps, and the step's flat input tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve.model.attention import AttentionInputs
from llmserve.sampling_params import SamplingParams
from llmserve.worker.persistent_batch import PersistentBatch, flat_positions, slot_mapping


@dataclass
class CachedRequestState:
    """What the runner knows of a request between steps (also a sample.SamplingRow). What changes every
    step (its token history, computed count, count of ids still on the device) lives in its row of the
    runner's PersistentBatch (`batch`, row `row`): the properties below read it there."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    stop_token_ids_for_min_tokens: list[int]
    batch: PersistentBatch
    row: int = -1  # its row in `batch`
    draft_probs: torch.Tensor | None = None  # [k, V] q of the drafts proposed last step (draft model)
    num_draft_computed: int = 0  # tokens whose KV the draft model has written (draft model)
    has_penalties: bool = False  # its sampling reads its output ids
    is_dynamic: bool = False  # its sampling inputs change with its tokens (penalties, min_tokens)
    is_plain_greedy: bool = False  # greedy with nothing else to apply: its sampling needs no per-row inputs

    def __post_init__(self) -> None:
        p = self.params
        self.has_penalties = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self.is_dynamic = self.has_penalties or bool(p.min_tokens)
        self.is_plain_greedy = (p.temperature == 0.0 and not self.is_dynamic and not p.logit_bias
                                and p.logprobs is None)

    @property
    def token_ids(self) -> np.ndarray:
        """[L] int64 prompt + output ids on the host: a view of its batch row, to read before the batch
        changes again (not to keep)."""
        return self.batch.token_ids[self.row, :self.batch.num_tokens[self.row]]

    @property
    def output_token_ids(self) -> list[int]:
        """Output ids on the host (a new list each time)."""
        return self.batch.token_ids[self.row, len(self.prompt_token_ids):self.batch.num_tokens[self.row]].tolist()

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed, or scheduled in a launched step (drafts until rolled back)."""
        return int(self.batch.num_computed[self.row])

    @num_computed_tokens.setter
    def num_computed_tokens(self, num: int) -> None:
        self.batch.num_computed[self.row] = num

    @property
    def num_pending(self) -> int:
        """Ids sampled on the device whose values are not on the host yet."""
        return int(self.batch.num_pending[self.row])

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, the ones still on the device included."""
        row = self.row
        return int(self.batch.num_tokens[row] + self.batch.num_pending[row]) - len(self.prompt_token_ids)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionInputs
    logits_indices: torch.Tensor  # [N] int64: per sampling row its last k + 1 tokens (k drafts; usually 0)
    sample_rows: list[int]  # [S] row index of each sampling row


def prepare_inputs(states: list[CachedRequestState], num_scheduled: list[int], block_size: int,
                   device: torch.device, drafts: list[list[int]] | None = None) -> StepInputs:
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
    return StepInputs(
        input_ids=on_device(input_ids, device),
        positions=on_device(positions, device),
        attn=attn,
        logits_indices=on_device(logits_indices(cu[1:][sample_rows], num_drafts[sample_rows]), device),
        sample_rows=sample_rows,
    )


def on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> tensor on device; on CUDA through pinned memory, non_blocking (the host never waits)."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor  # what .to(device) would return, without its dispatch
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def logits_indices(ends: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Per sampling row (its tokens end at `ends`): the last num_drafts + 1 token indices, flattened."""
    if not num_drafts.any():
        return ends - 1
    counts = num_drafts + 1  # [S]
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # [N]
    return np.repeat(ends - counts, counts) + offsets


def _token_slices(states: list[CachedRequestState], starts: np.ndarray, counts: np.ndarray,
                  drafts: list[list[int]] | None):
    for i, (state, start, count) in enumerate(zip(states, starts.tolist(), counts.tolist())):
        tokens = state.token_ids + drafts[i] if drafts and drafts[i] else state.token_ids
        yield from tokens[start:start + count]


def _block_table(states: list[CachedRequestState]) -> np.ndarray:
    max_blocks = max(len(s.block_ids) for s in states)
    table = np.zeros((len(states), max_blocks), dtype=np.int32)  # 0 = the null block
    for i, state in enumerate(states):
        table[i, :len(state.block_ids)] = state.block_ids
    return table
