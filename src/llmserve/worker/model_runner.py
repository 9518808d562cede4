"""Runs one scheduled step: keeps per-request state, builds inputs, runs the model, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmserve.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from llmserve.engine.messages import Logprobs
from llmserve.model.attention import AttentionBackend
from llmserve.sample.metadata import build_sampling_metadata
from llmserve.sample.sampler import Sampler
from llmserve.worker.input_batch import CachedRequestState, StepInputs, prepare_inputs


@dataclass
class StepTimes:
    """Seconds spent in each part of the runner's steps since the last reset."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    num_steps: int = 0


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 block_size: int, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.states: dict[str, CachedRequestState] = {}
        self.times = StepTimes()

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(sched_out)
        req_ids = list(sched_out.num_scheduled_tokens)
        states = [self.states[r] for r in req_ids]
        inputs = prepare_inputs(states, list(sched_out.num_scheduled_tokens.values()), self.block_size, self.device)
        t1 = time.perf_counter()
        logits = self._forward(inputs)  # [S, V]
        t2 = time.perf_counter()
        sampled, logprobs = self._sample(logits, [states[i] for i in inputs.sample_rows])
        t3 = time.perf_counter()
        self._advance(states, sched_out)
        out = self._runner_output(req_ids, inputs.sample_rows, sampled, logprobs)
        self.times.prepare += t1 - t0
        self.times.forward += t2 - t1
        self.times.sample += t3 - t2
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
    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        metadata = self.attn_backend.build_metadata(inputs.attn)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, metadata, self.attn_backend)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, rows: list[CachedRequestState]):
        if not rows:
            return [], None
        for row in rows:
            if row.generator is not None:
                row.generator.manual_seed(_position_seed(row.params.seed, len(row.output_token_ids)))
        meta = build_sampling_metadata(rows, self.vocab_size, self.device)
        out = self.sampler(logits, meta)
        sampled = out.sampled_token_ids.tolist()
        if out.logprobs is None:
            return sampled, None
        lp = out.logprobs
        return sampled, (lp.token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_ranks.tolist())

    def _advance(self, states: list[CachedRequestState], sched_out: SchedulerOutput) -> None:
        for state in states:
            state.num_computed_tokens += sched_out.num_scheduled_tokens[state.req_id]

    def _runner_output(self, req_ids: list[str], sample_rows: list[int], sampled: list[int],
                       logprobs) -> ModelRunnerOutput:
        token_ids: list[list[int]] = [[] for _ in req_ids]
        row_logprobs: list | None = [None] * len(req_ids) if logprobs is not None else None
        for j, row in enumerate(sample_rows):
            state = self.states[req_ids[row]]
            state.append_token(sampled[j])
            token_ids[row] = [sampled[j]]
            if logprobs is not None and state.params.logprobs is not None:
                k = state.params.logprobs + 1
                ids, lps, ranks = logprobs
                row_logprobs[row] = [Logprobs(ids[j][:k], lps[j][:k], ranks[j])]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=token_ids, logprobs=row_logprobs)


def _position_seed(seed: int, position: int) -> int:
    """The seed of one output position: a seeded request draws the same noise at the same position
    whatever its batch mates, and after a preemption it continues exactly where it was."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63)
