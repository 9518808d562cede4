"""The draft model's logits, optionally over a reduced vocabulary (`--draft-vocab-size N`).

A small draft spends most of a forward in its lm_head: the 2-layer draft of the Llama-3.1-8B shape reads
the 128,256 x 4,096 head, 1 GB in bf16, and smollm2-135m's two layers are 8M weights beside its 28M head
(docs/benchmarks.md has the times). EAGLE-3 and FR-Spec
(Zhao et al., 2025) give the draft a head over the most frequent tokens only; SGLang takes such a token
map for its drafts. Here the draft keeps the first N token ids, which BPE and SentencePiece vocabularies
give their most frequent tokens (merge order), or the first N of a token map (`--draft-token-map`: ids
ranked by frequency on text like the served one, as FR-Spec ranks them); its logits for every other id
are -inf, so it never proposes them. Speculation stays exact: a draft distribution q that is zero outside
the head is still a distribution, the rejection sampler's min(1, p/q) and its residual max(0, p - q) are
unchanged, and a greedy draft outside the head is simply never made. What it costs is acceptance where the
target's token is outside the head.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from llmserve.model.linear import can_pack, packed, packed_linear
from llmserve.sample import ops


def read_token_map(path: str, vocab_size: int) -> list[int]:
    """A JSON list of distinct token ids, most frequent first (`--draft-token-map`) -> the list."""
    try:
        with open(path, encoding="utf-8") as f:
            ids = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--draft-token-map: cannot read {path!r}: {e}") from None
    if not isinstance(ids, list) or not ids or not all(type(i) is int and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"--draft-token-map: {path!r} must hold a non-empty JSON list of token ids in [0, "
                         f"{vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"--draft-token-map: {path!r} lists a token id twice")
    return ids


class DraftHead:
    def __init__(self, model: torch.nn.Module, num_kept: int | None, token_map: list[int] | None = None) -> None:
        """model: the draft (a model/llama CausalLM); token_map: ids most frequent first (None: the
        vocabulary's own order, 0, 1, 2, ...); num_kept: N, the head keeps the map's first N ids (None: the
        whole map; neither given: the whole vocabulary through the model's own compute_logits)."""
        self.model = model
        self.vocab_size = model.config.vocab_size  # V: the logits' width either way
        self.ids = None  # [N] int64 on the device: the kept ids when they are not 0..N-1
        self.weight = None  # [N, H]: the kept rows (a view of a prefix, else a copy), or packed for the CPU
        self.is_packed = False
        if token_map is not None:
            token_map = token_map[:num_kept]
            is_prefix = token_map == list(range(len(token_map)))
            num_kept = len(token_map)
        self.num_kept = num_kept
        if num_kept is None:
            return
        head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
        assert getattr(head, "bias", None) is None, "Llama-family heads have no bias"
        assert head.weight is not None, "a reduced head reads the plain lm_head: load the draft with pack_head=False"
        if token_map is None or is_prefix:
            self._set_rows(head.weight[:num_kept])  # a view
        else:
            self.ids = torch.tensor(token_map, dtype=torch.int64, device=head.weight.device)
            self._set_rows(head.weight[self.ids])  # a copy

    def _set_rows(self, rows: torch.Tensor) -> None:
        """rows [N, H]: kept as they are, or packed for the CPU's linear path when they can be (our panels
        or oneDNN's layout, whichever the CPU takes: model/linear.py; faster than F.linear on the CPU,
        docs/benchmarks.md)."""
        self.weight, self.is_packed = rows, can_pack(rows)
        if self.is_packed:
            self.weight = packed(rows.contiguous())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> float32 logits [A, V]; -inf outside the kept ids."""
        if self.weight is None:
            return self.model.compute_logits(hidden).float()
        full = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), device=hidden.device)  # [A, V]
        if self.ids is None:
            full[:, :self.num_kept] = self._kept_logits(hidden)
        else:
            full[:, self.ids] = self._kept_logits(hidden).float()
        return full

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> [A] int64, the greedy draft."""
        if self.weight is None:
            return ops.argmax_rows(self.model.compute_logits(hidden).float())
        best = ops.argmax_rows(self._kept_logits(hidden).float())  # [A] index into the kept ids
        return best if self.ids is None else self.ids[best]

    def _kept_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> [A, N] in the model's dtype."""
        if self.is_packed:
            return packed_linear(hidden, self.weight, self.num_kept)
        return F.linear(hidden, self.weight)
