"""Runs one scheduled step: keeps per-request state, builds inputs, runs the model, samples.

With speculative decoding the step also verifies the drafts the scheduler placed after each row's
real tokens (worker.spec_verify) and asks the proposer for the next step's drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmserve.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from llmserve.engine.messages import Logprobs
from llmserve.model.attention import AttentionBackend
from llmserve.sample.metadata import build_sampling_metadata
from llmserve.sample.sampler import Sampler
from llmserve.spec.proposer import Proposer
from llmserve.worker.cuda_graphs import DecodeGraphs
from llmserve.worker.input_batch import CachedRequestState, StepInputs, prepare_inputs
from llmserve.worker.seeds import position_seed
from llmserve.worker.spec_verify import verify


@dataclass
class StepTimes:
    """Seconds spent in each part of the runner's steps since the last reset."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    propose: float = 0.0
    num_steps: int = 0


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 block_size: int, vocab_size: int, device: torch.device, seed: int = 0,
                 proposer: Proposer | None = None, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.proposer = proposer
        self.graphs = graphs  # CUDA graphs of decode steps (CUDA + Triton backend only)
        self.states: dict[str, CachedRequestState] = {}
        self.times = StepTimes()

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(sched_out)
        req_ids = list(sched_out.num_scheduled_tokens)
        states = [self.states[r] for r in req_ids]
        drafts = [sched_out.scheduled_spec_tokens.get(r, []) for r in req_ids]
        inputs = prepare_inputs(states, list(sched_out.num_scheduled_tokens.values()), self.block_size,
                                self.device, drafts if sched_out.scheduled_spec_tokens else None)
        t1 = time.perf_counter()
        logits = self._forward(inputs, bool(sched_out.scheduled_spec_tokens))  # [N, V]
        t2 = time.perf_counter()
        rows = [states[i] for i in inputs.sample_rows]
        if sched_out.scheduled_spec_tokens:
            row_drafts = [drafts[i] for i in inputs.sample_rows]
            draft_probs = [r.draft_probs for r in rows]
            sampled, logprobs = self._verify(logits, rows, row_drafts, draft_probs)
        else:
            sampled, logprobs = self._sample(logits, rows)
        t3 = time.perf_counter()
        self._advance(states, sched_out)
        out = self._runner_output(req_ids, inputs.sample_rows, sampled, logprobs)
        if self.proposer is not None:
            out.spec_token_ids = self._propose(req_ids, inputs.sample_rows, rows, sched_out.use_speculation)
        self.times.prepare += t1 - t0
        self.times.forward += t2 - t1
        self.times.sample += t3 - t2
        self.times.propose += time.perf_counter() - t3
        self.times.num_steps += 1
        return out

    def drop_finished(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)

    def _update_states(self, sched_out: SchedulerOutput) -> None:
        self.drop_finished(sched_out.finished_req_ids)
        for new in sched_out.new_reqs:
            self.states[new.req_id] = self._new_state(new)
        for cached in sched_out.cached_reqs:
            state = self.states[cached.req_id]
            del state.block_ids[cached.num_old_blocks:]  # blocks of rejected drafts the scheduler took back
            state.block_ids.extend(cached.new_block_ids)
            assert state.num_computed_tokens == cached.num_computed_tokens, "runner and scheduler disagree"

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device)
        return CachedRequestState(
            req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids), params=new.sampling_params, generator=generator,
            block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
            stop_token_ids_for_min_tokens=new.stop_token_ids_for_min_tokens)

    @torch.inference_mode()
    def _forward(self, inputs: StepInputs, has_drafts: bool) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs, has_drafts):
            hidden = self.graphs.run(inputs)  # [B, hidden]
        else:
            metadata = self.attn_backend.build_metadata(inputs.attn)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, metadata, self.attn_backend)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, rows: list[CachedRequestState]):
        """One token per sampling row: ([[token]] per row, per row [Logprobs] or None)."""
        if not rows:
            return [], None
        for row in rows:
            if row.generator is not None:
                row.generator.manual_seed(position_seed(row.params.seed, len(row.output_token_ids)))
        meta = build_sampling_metadata(rows, self.vocab_size, self.device)
        out = self.sampler(logits, meta)
        sampled = [[t] for t in out.sampled_token_ids.tolist()]
        if out.logprobs is None:
            return sampled, None
        lp = out.logprobs
        ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_ranks.tolist()
        logprobs = [None if row.params.logprobs is None else
                    [Logprobs(ids[j][:row.params.logprobs + 1], values[j][:row.params.logprobs + 1], ranks[j])]
                    for j, row in enumerate(rows)]
        return sampled, logprobs

    @torch.inference_mode()
    def _verify(self, logits: torch.Tensor, rows: list[CachedRequestState], drafts: list[list[int]],
                draft_probs: list[torch.Tensor | None]):
        return verify(self.sampler, logits, rows, drafts, draft_probs, self.vocab_size)

    def _advance(self, states: list[CachedRequestState], sched_out: SchedulerOutput) -> None:
        """Every scheduled token's KV is written; rejected drafts are rolled back in _runner_output."""
        for state in states:
            state.num_computed_tokens += sched_out.num_scheduled_tokens[state.req_id]

    def _runner_output(self, req_ids: list[str], sample_rows: list[int], sampled: list[list[int]],
                       logprobs: list | None) -> ModelRunnerOutput:
        token_ids: list[list[int]] = [[] for _ in req_ids]
        row_logprobs: list | None = [None] * len(req_ids) if logprobs is not None else None
        for j, row in enumerate(sample_rows):
            state = self.states[req_ids[row]]
            num_rejected = state.num_computed_tokens - len(state.token_ids) - len(sampled[j]) + 1
            state.num_computed_tokens -= num_rejected  # 0 without drafts
            for token_id in sampled[j]:
                state.append_token(token_id)
            token_ids[row] = sampled[j]
            if logprobs is not None:
                row_logprobs[row] = logprobs[j]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=token_ids, logprobs=row_logprobs)

    def _propose(self, req_ids: list[str], sample_rows: list[int], rows: list[CachedRequestState],
                 use_speculation: bool) -> list[list[int]]:
        """Drafts for the next step, per row of this step (none for rows that did not sample)."""
        proposals: list[list[int]] = [[] for _ in req_ids]
        wanted = [j for j, row in enumerate(rows) if use_speculation and row.params.speculative]
        for row in rows:
            row.draft_probs = None
        if not wanted:
            return proposals
        drafts, probs = self.proposer.propose([rows[j] for j in wanted])
        for j, row_drafts, row_probs in zip(wanted, drafts, probs):
            proposals[sample_rows[j]] = row_drafts
            rows[j].draft_probs = row_probs
        return proposals
