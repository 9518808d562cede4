"""EAGLE proposer: a draft head (model/eagle.py) over the target's hidden states proposes k tokens.

After every target forward the runner hands its tokens' features over (`take_features`); a row keeps those the
head has not consumed. The head's input at position p is the token at p + 1 with the target's feature at p, so
once a row holds L tokens, positions up to L - 2 can be consumed: a proposal catches the head up on them (the
prompt the first time; one to k + 1 positions after a decode or verification step), its output at L - 2 giving the
first draft, then runs k - 1 single-token forwards on its own output features. Features at L - 1 and past are
stale by then (the rejected drafts'), and dropped. The head's KV cache lives in the target's blocks, read through
the same block tables as a draft model's (spec/draft.py; the scheduler's lookahead slots cover the chain).
Positions the target never computed (a prefix-cache hit) are skipped: their blocks hold the head's KV from the
request that wrote them, if it speculated there; a stale one costs acceptance, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from llmserve.model.attention import AttentionBackend
from llmserve.sample.sampler import Sampler
from llmserve.spec.draft import sample_drafts
from llmserve.spec.draft_inputs import DraftInputs, DraftRow, first_group_blocks, prepare_inputs
from llmserve.spec.eagle_chain import EagleChain
from llmserve.spec.proposer import ProposerRow


@dataclass
class _Features:
    """A row's features not yet consumed: positions [start, end), in chunks as the forwards made them."""

    start: int
    end: int
    chunks: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] each, in position order

    def append(self, start: int, chunk: torch.Tensor) -> None:
        """chunk [n, F] of positions from `start` (<= end): any kept at or past `start` were a rejected draft's."""
        if start < self.end:
            kept = self.take(self.start, start) if start > self.start else None
            self.chunks = [] if kept is None else [kept]
            self.end = start
        self.chunks.append(chunk)
        self.end += len(chunk)

    def take(self, begin: int, end: int) -> torch.Tensor:
        """[end - begin, F] of positions [begin, end), within [start, end)."""
        joined = self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)
        return joined[begin - self.start:end - self.start]

    def clear(self, position: int) -> None:
        self.start = self.end = position
        self.chunks = []


class EagleProposer:
    needs_target_features = True

    def __init__(self, head: torch.nn.Module, attn_backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 block_size: int, num_speculative_tokens: int, max_model_len: int, device: torch.device,
                 seed: int = 0, num_kv_groups: int = 1, chain: EagleChain | None = None) -> None:
        self.head = head  # model.eagle.EagleDraft
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches  # per head layer [2, num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.num_kv_groups = num_kv_groups  # the target's; the head's blocks are the first group's
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed + 1))
        self.features: dict[str, _Features] = {}
        self.max_catch_up = 0
        self.num_skipped = 0  # rows a proposal gave no drafts for want of their features
        self.chain = chain  # the later forwards of plain greedy rows on the device (CUDA graphs), if captured
        self.num_chained = 0  # proposals whose later forwards ran there

    def take_features(self, rows: list[ProposerRow], starts: np.ndarray, counts: np.ndarray,
                      features: torch.Tensor) -> None:
        """features [T, F]: row i's counts[i] tokens from position starts[i]; copied (a graph's output is reused)."""
        offset = 0
        for row, start, count in zip(rows, starts.tolist(), counts.tolist()):
            chunk, offset = features[offset:offset + count], offset + count
            if not row.params.speculative:
                continue
            kept = self.features.get(row.req_id)
            if kept is None or not kept.start <= start <= kept.end:  # the first, a recompute, or a gap
                kept = self.features[row.req_id] = _Features(start, start)
            kept.append(start, chunk.clone())

    def can_propose_early(self, rows: list[ProposerRow], num_block_columns: int) -> bool:
        return False  # not behind the verification yet: the catch-up runs on the host's inputs

    def propose_early(self, rows: list[ProposerRow], step) -> None:
        raise AssertionError("can_propose_early is always False")

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.features.pop(req_id, None)

    def drop_features(self, rows: list[ProposerRow]) -> None:
        """A step that hands none over (Speculator.wants_features): its rows' kept features are stale from now."""
        if self.features:
            self.forget([row.req_id for row in rows])

    def check_integrity(self, req_ids: set[str]) -> None:
        """Features only of the runner's requests (`req_ids`), each row's chunks covering [start, end)."""
        assert set(self.features) <= req_ids, "features of a request the runner dropped"
        for kept in self.features.values():
            assert sum(len(c) for c in kept.chunks) == kept.end - kept.start, "a row's features have a gap"

    @torch.inference_mode()
    def propose(self, rows: list[ProposerRow]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        live, inputs, counts, features = [], [], [], []
        for i, row in enumerate(rows):
            length = len(row.token_ids)
            kept = self.features.get(row.req_id)
            begin = None if kept is None else max(row.num_draft_computed, kept.start)
            if begin is None or kept.end < length - 1 or begin >= length - 1 or length >= self.max_model_len:
                self.num_skipped += 1
                continue
            live.append(i)
            inputs.append(DraftRow(row.token_ids[1:], begin, self._blocks(row)))  # the token at p + 1 at p
            counts.append(length - 1 - begin)
            features.append(kept.take(begin, length - 1))
            kept.clear(length - 1)
            row.num_draft_computed = length - 1
        self.max_catch_up = max(counts, default=0)
        if not live:
            return drafts, [None] * len(rows)
        hidden, feature, step = self._forward(inputs, counts, torch.cat(features), True)
        if self._can_chain([rows[j] for j in live], step.attn.block_table.shape[1]):
            starts = np.asarray([len(rows[j].token_ids) - 1 for j in live])
            chained = self.chain.run(self.head.argmax(hidden), feature, starts, step.attn.block_table, self.k)
            self.num_chained += 1
            for j, row_drafts in zip(live, chained.tolist()):
                drafts[j] = row_drafts
            return drafts, [None] * len(rows)
        self._sample(rows, live, hidden, drafts, probs)
        for i in range(1, self.k):
            active = [a for a, j in enumerate(live) if len(rows[j].token_ids) + i < self.max_model_len]
            if not active:
                break
            live, feature = [live[a] for a in active], feature[active]
            inputs = [DraftRow([*rows[j].token_ids[1:].tolist(), *drafts[j]], len(rows[j].token_ids) + i - 2,
                               self._blocks(rows[j])) for j in live]
            hidden, feature, _ = self._forward(inputs, [1] * len(live), feature, False)
            self._sample(rows, live, hidden, drafts, probs)
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _can_chain(self, rows: list[ProposerRow], num_block_columns: int) -> bool:
        """Every row plain greedy, none reaching max_model_len within k drafts, and a captured size fits."""
        if self.chain is None or self.k < 2 or not all(r.is_plain_greedy for r in rows):
            return False
        if any(len(r.token_ids) + self.k - 1 >= self.max_model_len for r in rows):
            return False
        return self.chain.fits(len(rows), num_block_columns)

    def _forward(self, inputs: list[DraftRow], counts: list[int], features: torch.Tensor,
                 is_target: bool) -> tuple[torch.Tensor, torch.Tensor, DraftInputs]:
        """One head forward (features [T, F or H]) -> the head's hidden state and output feature [A, H] at each
        row's last token, and the forward's inputs."""
        step = prepare_inputs(inputs, counts, self.block_size, self.device)
        metadata = self.attn_backend.build_metadata(step.attn)
        hidden, out = self.head(step.input_ids, step.positions, features, is_target, self.kv_caches, metadata,
                                self.attn_backend)  # [T, H] each
        return hidden[step.logits_indices], out[step.logits_indices], step

    def _sample(self, rows: list[ProposerRow], live: list[int], hidden: torch.Tensor, drafts: list[list[int]],
                probs: list[list[torch.Tensor]]) -> None:
        """A draft for each `live` row from its hidden state [A, H] (and the random rows' q)."""
        tokens, q = sample_drafts(self.sampler, self.head.logits(hidden), [rows[j] for j in live],
                                  [drafts[j] for j in live])
        for a, j in enumerate(live):
            drafts[j].append(tokens[a])
            if q is not None and rows[j].params.temperature != 0.0:
                probs[j].append(q[a])

    def _blocks(self, row: ProposerRow) -> list[int]:
        return first_group_blocks(row.block_ids, self.num_kv_groups)
