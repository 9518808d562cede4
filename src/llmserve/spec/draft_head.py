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

from llmserve.sample import ops


class DraftHead:
    def __init__(self, model: torch.nn.Module, vocab_size: int | None) -> None:
        """model: the draft (a model/llama CausalLM); vocab_size: the head's token ids [0, N), or None:
        the whole vocabulary through the model's own compute_logits."""
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.num_kept = vocab_size
        self.weight = None  # [N, H]: the head's first N rows (a view, nothing copied)
        if vocab_size is not None:
            head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
            assert getattr(head, "bias", None) is None, "Llama-family heads have no bias"
            self.weight = head.weight[:vocab_size]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> float32 logits [A, V]; -inf outside the kept ids."""
        if self.weight is None:
            return self.model.compute_logits(hidden).float()
        full = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), device=hidden.device)  # [A, V]
        full[:, :self.num_kept] = F.linear(hidden, self.weight)
        return full

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> [A] int64, the greedy draft (the kept ids are a prefix: no mapping back)."""
        if self.weight is None:
            return ops.argmax_rows(self.model.compute_logits(hidden).float())
        return ops.argmax_rows(F.linear(hidden, self.weight).float())
