"""A forward's inputs as the runner builds them (worker/model_runner.py, worker/decode_window.py) and its
CUDA graphs replay them (worker/cuda_graphs.py); the arrays come from model/paged_indices.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.model.attention import AttentionInputs
from llmserve.model.quant.token_kinds import TokenKinds


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
