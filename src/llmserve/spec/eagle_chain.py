"""An EAGLE head's later forwards for plain greedy rows, kept on the device (a draft model's: spec/draft_chain.py).

After the catch-up forward each of the k - 1 later forwards feeds a row the draft the forward before chose and the
head's own output feature there; for plain greedy rows nothing comes from the host: positions and cache slots
follow from the rows' lengths and block tables (sent once), the feature is the previous forward's output, and the
k drafts come to the host once, at the end. The forwards run through the head's decode graphs: `HeadStep` is the
head as worker.cuda_graphs calls a model, its feature input read from a persistent buffer the chain fills before
each forward.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmserve.model.attention import AttentionBackend
from llmserve.model.paged_indices import slot_mapping
from llmserve.spec.draft_chain import DecodeForward


class HeadStep(nn.Module):
    """(input_ids, positions, kv_caches, metadata, backend) -> [T, 2H]: the head's hidden state for the logits and
    its next feature side by side, over the head's own features of the forward before (`features`)."""

    def __init__(self, head: nn.Module, max_tokens: int) -> None:
        super().__init__()
        self.head = head  # model.eagle.EagleDraft
        norm = head.layers[0].post_attention_layernorm.weight  # the head's dtype and device (linears may be packed)
        self.features = torch.zeros(max_tokens, head.config.hidden_size, dtype=norm.dtype, device=norm.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: object, attn_backend: AttentionBackend) -> torch.Tensor:
        features = self.features[:input_ids.shape[0]]  # [T, H]: a graph's padded rows read stale ones, harmlessly
        hidden, out = self.head(input_ids, positions, features, False, kv_caches, attn_metadata, attn_backend)
        return torch.cat([hidden, out], dim=-1)  # [T, 2H]


class EagleChain:
    def __init__(self, head: nn.Module, step: HeadStep, graphs: DecodeForward, block_size: int,
                 device: torch.device) -> None:
        self.head = head
        self.step = step
        self.graphs = graphs  # the head's decode graphs over `step` (or their eager buffers: use_graphs=False)
        self.block_size = block_size
        self.device = device

    def fits(self, num_rows: int, num_block_columns: int) -> bool:
        return self.graphs.fits(num_rows, num_block_columns)

    @torch.inference_mode()
    def run(self, first: torch.Tensor, feature: torch.Tensor, start: np.ndarray, table: torch.Tensor,
            k: int) -> torch.Tensor:
        """first [B] int64 and feature [B, H] on the device: each row's first draft and the head's output where it
        was drawn; start [B] on the host: the position the first draft is fed at (the row's length - 1); table
        [B, W] int32 on the device, covering positions up to start + k - 2. Returns the drafts [B, k] there."""
        num_rows, hidden_size = len(start), feature.shape[1]
        positions = torch.from_numpy(start.astype(np.int64)).to(self.device, non_blocking=True)  # [B]
        rows = torch.arange(num_rows, device=self.device)  # [B]
        drafts = [first]
        for _ in range(1, k):
            slots = slot_mapping(table, rows, positions, self.block_size)  # [B]
            self.step.features[:num_rows].copy_(feature)
            both = self.graphs.run_rows(drafts[-1], positions, slots, (positions + 1).int(), table)  # [B, 2H]
            feature = both[:, hidden_size:]
            drafts.append(self.head.argmax(both[:, :hidden_size]))  # [B]
            positions = positions + 1
        return torch.stack(drafts, dim=1)  # [B, k]
