"""A draft model's later forwards for plain greedy rows, kept on the device (issue 18).

A proposal's first draft forward catches the draft up on the real tokens (one or more a row); each of
its k - 1 later forwards feeds every row the draft the forward before chose, one token a row. When
every row takes the argmax of the raw logits (plain greedy: no penalties, bias or min_tokens), those
forwards need nothing from the host: a forward's input ids are the previous forward's argmax, its
positions and cache slots follow from the rows' lengths and block tables (sent once), and the k drafts
come to the host once, at the end. The forwards run through the draft's decode CUDA graphs
(worker.cuda_graphs): no host round trip and no kernel launches of their own between the k forwards.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from llmserve.model.step_inputs import slot_mapping
from llmserve.sample import ops


class DecodeForward(Protocol):
    """The draft model's decode forward over persistent buffers (worker.cuda_graphs.DecodeGraphs; spec/
    may not import worker/, which holds the speculator)."""

    def fits(self, num_rows: int, num_block_columns: int) -> bool: ...

    def run_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor: ...


class DraftChain:
    def __init__(self, model: torch.nn.Module, graphs: DecodeForward, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.graphs = graphs  # the draft model's decode graphs (or their eager buffers: use_graphs=False)
        self.block_size = block_size
        self.device = device

    def fits(self, num_rows: int, num_block_columns: int) -> bool:
        return self.graphs.fits(num_rows, num_block_columns)

    @torch.inference_mode()
    def run(self, first: torch.Tensor, lengths: np.ndarray, table: torch.Tensor, k: int) -> torch.Tensor:
        """first [B] int64 on the device: each row's first draft (sampled at its last real token);
        lengths [B] on the host: the rows' real tokens (the first draft's position); table [B, W] int32 on
        the device, the rows' blocks (covering positions up to lengths + k - 2). Returns the drafts [B, k]
        on the device: first, then k - 1 argmaxes, forward i feeding draft i - 1 at position
        lengths + i - 1."""
        rows = torch.arange(len(lengths), device=self.device)  # [B]
        start = torch.from_numpy(lengths.astype(np.int64)).to(self.device, non_blocking=True)  # [B]
        drafts = [first]
        for i in range(1, k):
            positions = start + (i - 1)  # [B]
            slots = slot_mapping(table, rows, positions, self.block_size)  # [B]
            hidden = self.graphs.run_rows(drafts[-1], positions, slots, (positions + 1).int(), table)  # [B, H]
            drafts.append(ops.argmax_rows(self.model.compute_logits(hidden).float()))  # [B]
        return torch.stack(drafts, dim=1)  # [B, k]
