"""Draft-model proposer: a smaller checkpoint with the target's tokenizer proposes k tokens.

It runs inside the engine step on its own paged KV cache, which has the target's number of blocks
and is indexed by the same block tables, so the scheduler's allocation covers both (plus k
lookahead slots for the tokens it proposes). With KV cache groups (core/kv_cache_groups.py: a row's block
ids interleave the groups) the draft's blocks are the first group's, a full-attention one, which keeps every
block of the sequence while sliding groups give theirs back; the draft's own layers, full or sliding, read
them as a one-group model's. Each proposal first catches the draft up on the real
tokens it has not seen (the prompt the first time; then the tokens accepted last step), sampling the
first draft at the last of them, then runs k - 1 single-token forwards. When every row is plain greedy
and a `DraftChain` is given (CUDA graphs of the draft), those k - 1 forwards stay on the device
(spec.draft_chain); otherwise each is built and sampled on the host. After a verification step whose
rows all carried k drafts, the whole proposal can be queued on the device right behind it
(`propose_early`, the chain's `run_after_verify`); `propose` then only brings its drafts to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.model.attention import AttentionBackend
from llmserve.sample import ops
from llmserve.sample.metadata import PositionRow, build_sampling_metadata
from llmserve.sample.sampler import Sampler
from llmserve.sample.seeds import position_seed
from llmserve.spec.draft_chain import DraftChain, VerifiedStep
from llmserve.spec.draft_head import DraftHead
from llmserve.spec.draft_inputs import DraftInputs, DraftRow, first_group_blocks, prepare_inputs
from llmserve.spec.proposer import ProposerRow

_DRAFT_SEED_OFFSET = 1 << 40  # seeded requests draw their draft noise from positions of their own


class DraftModelProposer:
    needs_target_features = False  # the draft reads tokens only

    def __init__(self, model: torch.nn.Module, head: DraftHead, attn_backend: AttentionBackend,
                 kv_caches: list[torch.Tensor], block_size: int, num_speculative_tokens: int, max_model_len: int,
                 device: torch.device, seed: int = 0, chain: DraftChain | None = None,
                 num_kv_groups: int = 1) -> None:
        self.model = model
        self.num_kv_groups = num_kv_groups  # the target's; the draft's blocks are every num_kv_groups-th id
        self.head = head  # its logits, maybe over a reduced vocabulary (spec/draft_head.py)
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches  # per draft layer [2, num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed + 1))
        self.chain = chain
        self.num_chained = 0  # proposals whose later forwards ran on the device
        self.num_early = 0  # proposals queued behind their verification (propose_early)
        self.max_catch_up = 0  # the most real tokens a row caught up on in the last proposal
        # propose_early's proposal: the rows' ids, their drafts [B, k] and new lengths [B] on the device
        self.early: tuple[list[str], torch.Tensor, torch.Tensor] | None = None

    def can_propose_early(self, rows: list[ProposerRow], num_block_columns: int) -> bool:
        """Rows about to be verified with k drafts each: plain greedy, their draft KV caught up to the
        verification's first token, room for 2k more positions, and captured sizes that fit."""
        if self.chain is None or self.chain.catch_up is None or self.k < 2:
            return False  # the first check a step makes without --speculative-queue-drafts
        if not all(r.is_plain_greedy for r in rows):
            return False
        if any(r.num_draft_computed < len(r.token_ids) - 1 or len(r.token_ids) + 2 * self.k >= self.max_model_len
               for r in rows):
            return False
        return self.chain.fits_after_verify(len(rows), num_block_columns)

    def propose_early(self, rows: list[ProposerRow], step: VerifiedStep) -> None:
        """Queue the rows' next proposal behind their verification (can_propose_early said yes)."""
        drafts, lengths = self.chain.run_after_verify(step, self.k)
        self.early = [r.req_id for r in rows], drafts, lengths

    def _take_early(self, rows: list[ProposerRow]) -> list[list[int]] | None:
        """The early proposal's drafts when it was made for these rows at their current lengths."""
        early, self.early = self.early, None
        if early is None or early[0] != [r.req_id for r in rows]:
            return None
        if early[2].tolist() != [len(r.token_ids) for r in rows]:  # a guard: made at these rows' lengths
            return None
        self.num_early += 1
        return early[1].tolist()

    @torch.inference_mode()
    def propose(self, rows: list[ProposerRow]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        counts = [len(r.token_ids) - r.num_draft_computed for r in rows]  # the real tokens each catches up on
        self.max_catch_up = max(counts)
        early = self._take_early(rows)
        if early is not None:
            for row in rows:
                row.num_draft_computed = len(row.token_ids)
            return early, [None] * len(rows)
        inputs = [DraftRow(r.token_ids, r.num_draft_computed, self._blocks(r)) for r in rows]
        if self._can_chain(rows):
            return self._propose_chained(rows, inputs, counts), [None] * len(rows)
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        self._step(rows, list(range(len(rows))), inputs, counts, drafts, probs)
        for row in rows:
            row.num_draft_computed = len(row.token_ids)
        for i in range(1, self.k):
            active = [j for j, r in enumerate(rows) if len(r.token_ids) + i < self.max_model_len]
            if not active:
                break
            inputs = [DraftRow([*rows[j].token_ids.tolist(), *drafts[j]], len(rows[j].token_ids) + i - 1,
                                  self._blocks(rows[j])) for j in active]
            self._step(rows, active, inputs, [1] * len(active), drafts, probs)
        return drafts, [torch.stack(p) if p else None for p in probs]

    def _can_chain(self, rows: list[ProposerRow]) -> bool:
        """Every row plain greedy, none reaching max_model_len within k drafts, and a captured size fits."""
        if self.chain is None or self.k < 2 or not all(r.is_plain_greedy for r in rows):
            return False
        if any(len(r.token_ids) + self.k - 1 >= self.max_model_len for r in rows):
            return False
        return self.chain.fits(len(rows), max(len(self._blocks(r)) for r in rows))

    def _blocks(self, row: ProposerRow) -> list[int]:
        return first_group_blocks(row.block_ids, self.num_kv_groups)

    def _propose_chained(self, rows: list[ProposerRow], inputs: list[DraftRow],
                         counts: list[int]) -> list[list[int]]:
        """The catch-up forward on the host's inputs, then the chain on the device; one copy to the host."""
        lengths = np.asarray([len(r.token_ids) for r in rows], dtype=np.int64)  # [B]
        logits, step = self._forward(inputs, counts)  # [B, V]
        first = ops.argmax_rows(logits)  # [B]
        for row in rows:
            row.num_draft_computed = len(row.token_ids)
        self.num_chained += 1
        return self.chain.run(first, lengths, step.attn.block_table, self.k).tolist()

    def forget(self, req_ids) -> None:
        """Nothing kept per request: its draft KV lives in the blocks the scheduler frees."""

    def _step(self, rows: list[ProposerRow], active: list[int], inputs: list[DraftRow], counts: list[int],
              drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
        """One draft forward over `active` rows; appends one draft (and its q for random rows) to each."""
        logits, _ = self._forward(inputs, counts)  # [A, V]
        tokens, q = self._sample(logits, [rows[j] for j in active], [drafts[j] for j in active])
        for a, j in enumerate(active):
            drafts[j].append(tokens[a])
            if q is not None and rows[j].params.temperature != 0.0:
                probs[j].append(q[a])

    def _forward(self, inputs: list[DraftRow], counts: list[int]) -> tuple[torch.Tensor, DraftInputs]:
        """One draft forward of `counts` tokens a row -> float32 logits [A, V] at each row's last token,
        and the forward's inputs."""
        step = prepare_inputs(inputs, counts, self.block_size, self.device)
        metadata = self.attn_backend.build_metadata(step.attn)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, metadata, self.attn_backend)
        return self.head.logits(hidden[step.logits_indices]), step

    def _sample(self, logits: torch.Tensor, rows: list[ProposerRow],
                drafts: list[list[int]]) -> tuple[list[int], torch.Tensor | None]:
        return sample_drafts(self.sampler, logits, rows, drafts)


def sample_drafts(sampler: Sampler, logits: torch.Tensor, rows: list[ProposerRow],
                  drafts: list[list[int]]) -> tuple[list[int], torch.Tensor | None]:
    """logits [A, V] -> a draft per row and q [A, V], the distribution the random rows drew from.
    q is processed like the target's p (penalties, temperature, top-k/p, min-p): the closer q is to
    p, the more drafts are accepted. Plain greedy rows only: the argmax, nothing else to apply."""
    if all(r.is_plain_greedy for r in rows):
        return ops.argmax_rows(logits).tolist(), None
    positions = [PositionRow(r.params, r.prompt_token_ids, r.output_token_ids + d, None,
                             r.stop_token_ids_for_min_tokens) for r, d in zip(rows, drafts)]
    for position in positions:
        if position.params.seed is not None and position.params.temperature != 0.0:
            position.generator = torch.Generator(device=logits.device)
            position.generator.manual_seed(position_seed(position.params.seed,
                                                         _DRAFT_SEED_OFFSET + len(position.output_token_ids)))
    meta = build_sampling_metadata(positions, logits.shape[1], logits.device)
    out = sampler(logits, meta, keep_probs=True)
    return out.sampled_token_ids.tolist(), out.probs
