"""The draft model's logits, optionally over a reduced vocabulary (`--draft-vocab-size N`, issue 18).

A small draft spends most of a forward in its lm_head: the 2-layer draft of the Llama-3.1-8B shape reads
the 128,256 x 4,096 head, 1 GB in bf16 (368 us of a draft forward on an H100, 1.84 ms of a speculative
step at k = 4), and smollm2-135m's two layers are 8M weights beside its 28M head. EAGLE-3 and FR-Spec
(Zhao et al., 2025) give the draft a head over the most frequent tokens only; SGLang takes such a token
map for its drafts. Here the draft keeps the first N token ids, which BPE and SentencePiece vocabularies
give their most frequent tokens (merge order); its logits for every other id are -inf, so it never
proposes them. Speculation stays exact: a draft distribution q that is zero outside the head is still a
distribution, the rejection sampler's min(1, p/q) and its residual max(0, p - q) are unchanged, and a greedy
draft outside the head is simply never made. What it costs is acceptance where the target's token is
outside the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.model.linear import can_pack, packed, packed_linear
from llmserve.sample import ops


class DraftHead:
    def __init__(self, model: torch.nn.Module, num_kept: int | None) -> None:
        """model: the draft (a model/llama CausalLM); num_kept: N, the head keeps token ids [0, N); None:
        the whole vocabulary through the model's own compute_logits."""
        self.model = model
        self.vocab_size = model.config.vocab_size  # V: the logits' width either way
        self.num_kept = num_kept
        self.weight = None  # [N, H]: the head's first N rows (a view), or the same packed for the CPU
        self.is_packed = False
        if num_kept is not None:
            head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
            assert getattr(head, "bias", None) is None, "Llama-family heads have no bias"
            self._keep_rows(head, num_kept)

    def _keep_rows(self, head: torch.nn.Module, num: int) -> None:
        """The head's first `num` rows: sliced from its weight, or from the panels a float32 CPU model
        packed its lm_head into at load (16 rows a panel: model/linear.py); packed when it can be (on the
        CPU 5-12x F.linear's speed: docs/benchmarks.md)."""
        if head.weight is not None:
            self.weight = head.weight[:num]
            self.is_packed = can_pack(self.weight)
            if self.is_packed:
                self.weight = packed(self.weight.contiguous())
            return
        panels = head.packed_weight  # [P, H, 16], or oneDNN's own layout (2-D), which cannot be sliced
        if panels.dim() != 3:
            raise ValueError("--draft-vocab-size: this CPU packs the draft's own lm_head for oneDNN, which "
                             "cannot keep only its first rows; use a draft with tied embeddings, or none")
        self.weight, self.is_packed = panels[:-(-num // 16)], True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> float32 logits [A, V]; -inf outside the kept ids."""
        if self.weight is None:
            return self.model.compute_logits(hidden).float()
        full = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), device=hidden.device)  # [A, V]
        full[:, :self.num_kept] = self._kept_logits(hidden)
        return full

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> [A] int64, the greedy draft (the kept ids are a prefix: no mapping back)."""
        if self.weight is None:
            return ops.argmax_rows(self.model.compute_logits(hidden).float())
        return ops.argmax_rows(self._kept_logits(hidden).float())

    def _kept_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> [A, N] in the model's dtype."""
        if self.is_packed:
            return packed_linear(hidden, self.weight, self.num_kept)
        return F.linear(hidden, self.weight)
