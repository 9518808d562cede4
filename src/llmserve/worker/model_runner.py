"""Runs scheduled steps: keeps per-request state and the persistent batch, builds inputs, runs the
model, samples.

A step is `launch` (inputs, forward, sampling queued on the device; the sampled ids stay there) and
`finish` (the ids on the host, turned into the step's output). `execute` is both at once. With async
scheduling the engine launches step N+1 before it finishes step N: rows whose last token is still on
the device read it there (PersistentBatch.gather), and penalties read their rows' tokens there too
(worker.penalty_tokens). A step with drafts to verify or propose finishes the step in flight first.

With speculative decoding the runner's Speculator (spec.speculator) verifies the drafts the scheduler
placed after each row's real tokens, and proposes the next step's drafts; the output reports per row how
many drafts were accepted, and the scheduler rolls the rest back (the runner takes its count from the
next step's diff).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from operator import attrgetter

import numpy as np
import torch

from llmserve.core.kv_cache_groups import KVCacheLayout
from llmserve.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from llmserve.model.attention import AttentionBackend
from llmserve.model.paged_indices import on_device
from llmserve.model.parallel import TensorParallel
from llmserve.model.quant.token_kinds import step_kinds_of
from llmserve.sample.sampler import Sampler, SamplerOutput
from llmserve.spec.draft_chain import VerifiedStep
from llmserve.spec.speculator import Speculator
from llmserve.structured.bitmask import BitmaskFiller
from llmserve.worker.cpu_threads import xgrammar_threads
from llmserve.worker.cuda_graphs import DecodeGraphs
from llmserve.worker.mixed_graphs import MixedGraphs
from llmserve.worker.decode_window import WindowEnds, run_window
from llmserve.worker.input_batch import CachedRequestState
from llmserve.worker.lora_manager import LoRAManager
from llmserve.worker.persistent_batch import PersistentBatch
from llmserve.worker.pooler import Pooler
from llmserve.worker.prompt_logprobs import plan_prompt_logprobs, score_prompt
from llmserve.worker.sampling_step import SamplingInputs
from llmserve.worker.speculation import begin_spec_step, hand_features, propose_drafts
from llmserve.worker.step_handle import HostCopy, StepHandle, start_host_copy
from llmserve.worker.step_inputs import StepInputBuilder, StepInputs
from llmserve.worker.step_times import StepTimes, mark
from llmserve.worker.step_output import StepOutput


_ROW = attrgetter("row")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 block_size: int, vocab_size: int, device: torch.device, seed: int = 0,
                 speculator: Speculator | None = None, graphs: DecodeGraphs | None = None,
                 max_num_rows: int = 128, max_model_len: int = 4096, tp: TensorParallel | None = None,
                 pooler: Pooler | None = None, kv_layout: KVCacheLayout | None = None,
                 lora: LoRAManager | None = None) -> None:
        """pooler: an embedding model's (--runner pooling): steps pool prompts instead of sampling.
        kv_layout: the KV cache groups (core/kv_cache_groups.py), each with its own block table; None: one.
        lora: adapters' slots and each forward's token -> slot map (None: LoRA off)."""
        self.model = model
        self.pooler = pooler
        self.kv_layout = kv_layout if kv_layout is not None and kv_layout.is_hybrid else None
        self.lora = lora
        # FP8 layers on CUDA route decode and prompt tokens by what each step says (model/quant/token_kinds.py)
        self.step_kinds = step_kinds_of(model) if device.type == "cuda" else None
        self.tp = tp  # tensor parallelism: rank 0 samples, the other ranks take its ids (_sample)
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, Hkv, D]
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.sampling = SamplingInputs(vocab_size, device)
        self.bitmasks = BitmaskFiller(vocab_size, device, xgrammar_threads())
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.speculator = speculator
        # an EAGLE head reads the target's hidden states of every forward (spec/eagle.py)
        self.has_feature_reader = speculator is not None and speculator.proposer.needs_target_features
        self.graphs = graphs  # CUDA graphs of decode steps (CUDA + Triton backend only)
        self.verify_graphs: DecodeGraphs | None = None  # of verification steps (speculation; set by the Worker)
        self.mixed_graphs: MixedGraphs | None = None  # of mixed steps: prompts beside decode rows (set by the Worker)
        self.states: dict[str, CachedRequestState] = {}
        self.num_not_plain_greedy = 0  # states whose sampling needs per-row inputs (SamplingInputs)
        self.prompt_scorers: set[str] = set()  # states that ask for prompt logprobs
        self.batch = PersistentBatch(max_num_rows, max_model_len, block_size,
                                     1 if self.kv_layout is None else self.kv_layout.num_groups)
        self.step_output = StepOutput(self.batch, self.sampling.penalty_tokens)
        self.in_flight: StepHandle | None = None  # launched last and not finished
        self._last_rows: tuple[list[str], list[CachedRequestState], np.ndarray] | None = None  # step_rows
        self.times = StepTimes()
        self.inputs = StepInputBuilder(self.batch, device, self.kv_layout is not None, self.step_kinds, self.times)
        self.sync_timing = False
        self.window_ends = WindowEnds()  # where a multi-step window may end early (worker/decode_window.py)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """launch and finish at once: the step's sampled ids never wait on the device, so the batch keeps
        no pending-id bookkeeping for them (no row is taken over before they are appended). A multi-step
        window runs its forwards in worker/decode_window.py."""
        if sched_out.num_steps > 1:
            return run_window(self, sched_out)
        return self.finish(self.launch(sched_out, finishes_at_once=True))

    @torch.inference_mode()  # every tensor the runner keeps is made and updated in inference mode
    def launch(self, sched_out: SchedulerOutput, finishes_at_once: bool = False,
               catch_up: Callable[[], None] | None = None) -> StepHandle:
        """Launch the step: forward, then sampling (the ids stay on the device until `finish`). `catch_up`, where
        the step has grammars: called once the forward is queued and before the bitmask is filled, so that the
        engine finishes the step in flight and its grammars take that step's tokens while the device runs this
        step's forward."""
        t0 = time.perf_counter()
        self._update_states(sched_out)
        req_ids = list(sched_out.num_scheduled_tokens)
        states, step_rows = self.step_rows(req_ids)  # step_rows [B]: the rows' batch rows
        if self.pooler is not None:
            assert finishes_at_once, "pooling steps run in order (no async scheduling)"
            return self._pool_step(sched_out, req_ids, states, step_rows, t0)
        has_drafts = bool(sched_out.scheduled_spec_tokens)
        if has_drafts or sched_out.use_speculation:
            self.finish_in_flight()
            if self.speculator is not None:
                begin_spec_step(self.speculator, sched_out)
        prompt_plan = None
        if self.prompt_scorers:
            prompt_plan = plan_prompt_logprobs(states, list(sched_out.num_scheduled_tokens.values()))
        starts = self.batch.num_computed[step_rows].copy() if self.has_feature_reader else None  # [B]
        # batch_rows [S]: the sampling rows'
        inputs, batch_rows = self.inputs.build(states, step_rows, sched_out, finishes_at_once, self.in_flight)
        if self.lora is not None:
            self.lora.begin_forward(step_rows, np.fromiter(sched_out.num_scheduled_tokens.values(), np.int64))
        t1 = mark(self.device, self.sync_timing)
        hidden, logits = self._forward(inputs, has_drafts)  # [T, hidden], [N, V]
        if starts is not None:
            counts = np.fromiter(sched_out.num_scheduled_tokens.values(), np.int64, count=len(states))  # [B]
            hand_features(self.speculator, self.model, states, starts, counts, hidden)
        if sched_out.grammar is not None:  # filled on the host while the device runs the forward
            if catch_up is not None:
                self.in_flight = None  # this step's inputs have marked its rows' samples as the pending ones
                catch_up()
            bitmask, indices = self.bitmasks.fill(sched_out.grammar, [req_ids[i] for i in inputs.sample_rows])
            self.bitmasks.apply(logits, bitmask, indices)
        t2 = mark(self.device, self.sync_timing)
        rows = states if len(inputs.sample_rows) == len(states) else [states[i] for i in inputs.sample_rows]
        scored = score_prompt(self.model, hidden, prompt_plan) if prompt_plan else {}
        if has_drafts:
            handle = self._verify_step(req_ids, inputs, batch_rows, logits, rows, sched_out)
            handle.copy = HostCopy.start(scored)
        else:
            handle = self._sample_step(req_ids, inputs.sample_rows, batch_rows, logits, rows, scored, finishes_at_once)
        handle.prompt_plan = prompt_plan
        t3 = mark(self.device, self.sync_timing)
        handle.use_speculation = sched_out.use_speculation
        self.in_flight = handle
        self.times.add(t0, t1, t2, t3)
        return handle

    def decode_forward(self, inputs: StepInputs, batch_rows: np.ndarray, states: list[CachedRequestState],
                       started: float) -> np.ndarray:
        """One forward of one token a row (a window's later forward, worker/decode_window.py) over batch rows
        [B]: their sampled ids [B] on the host. No handle: nothing of it stays pending. `started`: when its
        inputs began to be built (counted as its preparation)."""
        if self.lora is not None:
            self.lora.begin_forward(batch_rows, None)
        t1 = mark(self.device, self.sync_timing)
        hidden, logits = self._forward(inputs, False)  # [B, hidden], [B, V]
        if self.has_feature_reader:  # the window set num_computed past this forward's tokens
            starts = self.batch.num_computed[batch_rows] - 1  # [B]
            hand_features(self.speculator, self.model, states, starts, np.ones_like(starts), hidden)
        t2 = mark(self.device, self.sync_timing)
        sampled = self._sample(logits, states).sampled_token_ids  # [B]
        self._note_penalized(batch_rows, sampled)
        host = sampled.numpy() if sampled.device.type == "cpu" else sampled.cpu().numpy()  # [B]
        self.times.add(started, t1, t2, mark(self.device, self.sync_timing))
        return host

    @torch.inference_mode()
    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """The step's output (waits for its sampled ids); steps finish in the order they launched."""
        if handle.output is None:
            t0 = time.perf_counter()
            handle.output = self.step_output.output(handle)
            if handle is self.in_flight:
                self.batch.clear_pending()
                self.in_flight = None
            if self.speculator is not None:
                self.speculator.end_step()
                handle.output.spec_token_ids = propose_drafts(self.speculator, self.states, handle)
            self.times.propose += time.perf_counter() - t0
        return handle.output

    def finish_in_flight(self) -> None:
        """Bring the step in flight to the host now (the engine takes its output later)."""
        if self.in_flight is not None:
            self.finish(self.in_flight)

    def has_in_flight(self) -> bool:
        return self.in_flight is not None

    def drop_finished(self, req_ids: set[str]) -> None:
        if self.speculator is not None:
            self.speculator.forget(req_ids)
        if self.pooler is not None:
            self.pooler.forget(req_ids)
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self.num_not_plain_greedy -= not state.is_plain_greedy
                if self.lora is not None:
                    self.lora.release(state.row)
                self.batch.remove(req_id)
                self.prompt_scorers.discard(req_id)
                self._last_rows = None

    def step_rows(self, req_ids: list[str]) -> tuple[list[CachedRequestState], np.ndarray]:
        """The step's states and [B] their batch rows: the last step's while the same requests run in the
        same order and no state came or went (the common decode step)."""
        if self._last_rows is None or self._last_rows[0] != req_ids:
            states = list(map(self.states.__getitem__, req_ids))
            self._last_rows = req_ids, states, np.fromiter(map(_ROW, states), np.int64, count=len(states))
        return self._last_rows[1], self._last_rows[2]

    # ---- states from the scheduler's diff ------------------------------------------------------------

    def _update_states(self, sched_out: SchedulerOutput) -> None:
        self.drop_finished(sched_out.finished_req_ids)
        if sched_out.new_reqs:
            self.sampling.invalidate()
        for new in sched_out.new_reqs:
            state = self.states[new.req_id] = self._new_state(new)
            self.num_not_plain_greedy += not state.is_plain_greedy
            self._last_rows = None
            if state.has_penalties:
                self.sampling.penalty_tokens.add(state)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_scorers.add(new.req_id)
        appended: list[tuple[int, int, int]] = []  # (row, column, block id): new blocks after the old ones
        for cached in sched_out.cached_reqs:
            state = self.states[cached.req_id]
            if self.speculator is not None and state.num_computed_tokens != cached.num_computed_tokens:
                # rejected drafts, rolled back there (without drafts the two counts never part)
                assert cached.num_computed_tokens < state.num_computed_tokens, "runner and scheduler disagree"
                state.num_computed_tokens = cached.num_computed_tokens
            if not cached.new_block_ids and cached.num_old_blocks == len(state.block_ids):
                continue  # the common decode step: no block changed
            if cached.num_old_blocks == len(state.block_ids):  # a decode row grew (one block, or a window's)
                appended.extend((state.row, cached.num_old_blocks + i, block_id)
                                for i, block_id in enumerate(cached.new_block_ids))
            else:
                self.batch.set_blocks(state.row, cached.num_old_blocks, cached.new_block_ids)
            del state.block_ids[cached.num_old_blocks:]  # blocks of rejected drafts the scheduler took back
            state.block_ids.extend(cached.new_block_ids)
        if appended:
            self.batch.append_blocks(np.array(appended, np.int64))

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        """The request's state, and its row in the batch (a resumed request brings its outputs)."""
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device)
        state = CachedRequestState(
            req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids), params=new.sampling_params,
            generator=generator, block_ids=list(new.block_ids),
            stop_token_ids_for_min_tokens=new.stop_token_ids_for_min_tokens, batch=self.batch)
        state.row = self.batch.add(new.req_id, [*new.prompt_token_ids, *new.output_token_ids], state.block_ids,
                                   state.has_penalties, new.num_computed_tokens, len(new.prompt_token_ids))
        if self.lora is not None:
            self.lora.acquire(state.row, new.lora)
        return state

    # ---- forward -------------------------------------------------------------------------

    def attn_metadata(self, inputs: StepInputs) -> object:
        """What the model's layers read: the backend's metadata, or with KV cache groups [L] each layer's
        group's (built once a group)."""
        if inputs.attn_groups is None:
            return self.attn_backend.build_metadata(inputs.attn)
        groups = [self.attn_backend.build_metadata(attn) for attn in inputs.attn_groups]
        return [groups[group] for group in self.kv_layout.layer_groups]

    def _pool_step(self, sched_out: SchedulerOutput, req_ids: list[str], states: list[CachedRequestState],
                   rows: np.ndarray, t0: float) -> StepHandle:
        """A pooling step: the forward, then the rows whose prompt ends here pooled (worker/pooler.py);
        nothing is sampled, so the step's output is known when it returns."""
        starts = self.batch.num_computed[rows].copy()  # [B]
        counts = np.fromiter(sched_out.num_scheduled_tokens.values(), np.int64, count=len(rows))  # [B]
        num_prompt = self.batch.num_prompt[rows]  # [B]
        inputs, _ = self.inputs.build(states, rows, sched_out, True, self.in_flight)
        t1 = mark(self.device, self.sync_timing)
        hidden = self._hidden(inputs, False)  # [T, hidden]
        t2 = mark(self.device, self.sync_timing)
        pooled = self.pooler.pool(hidden, req_ids, starts, counts, num_prompt)
        output = ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooled=pooled)
        no_rows = np.empty(0, np.int64)
        handle = StepHandle(req_ids, no_rows, torch.empty(0, dtype=torch.int64), HostCopy({}), no_rows, None,
                            output=output)
        self.times.add(t0, t1, t2, mark(self.device, self.sync_timing))
        return handle

    @torch.inference_mode()
    def _forward(self, inputs: StepInputs, has_drafts: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] and the sampling rows' logits [N, V]."""
        graphs = self.verify_graphs if has_drafts else self.graphs
        if graphs is None and self.mixed_graphs is None and self.step_kinds is None and inputs.attn_groups is None:
            # CPU: maybe one C++ call
            self.times.num_tokens += len(inputs.input_ids)
            return self.model.forward_logits(inputs.input_ids, inputs.positions, self.kv_caches,
                                              self.attn_metadata(inputs), self.attn_backend, inputs.logits_indices)
        hidden = self._hidden(inputs, has_drafts)
        return hidden, self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def _hidden(self, inputs: StepInputs, has_drafts: bool) -> torch.Tensor:
        self.times.num_tokens += len(inputs.input_ids)
        graphs = self.verify_graphs if has_drafts else self.graphs
        kinds = inputs.token_kinds
        assert self.step_kinds is None or kinds is not None, "FP8 layers need the step's token kinds"
        if graphs is not None and graphs.can_run(inputs, has_drafts):
            hidden = graphs.run(inputs)  # [T, hidden]; captured with every token a decode token
        elif self.mixed_graphs is not None and self.mixed_graphs.can_run(inputs, has_drafts):
            hidden = self.mixed_graphs.run(inputs)  # [T, hidden]
        else:
            metadata = self.attn_metadata(inputs)
            with nullcontext() if self.step_kinds is None else self.step_kinds.using(kinds):
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, metadata, self.attn_backend)
        return hidden

    # ---- sampling -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _sample_step(self, req_ids: list[str], sample_rows: list[int], batch_rows: np.ndarray, logits: torch.Tensor,
                     rows: list[CachedRequestState], extra: dict[str, torch.Tensor],
                     finishes_at_once: bool = False) -> StepHandle:
        """Sample on the device and start copying the ids (and `extra` tensors) to the host; unless the step
        finishes at once, the rows' next token is pending (and the handle keeps the rows' serials)."""
        if not rows:
            empty = SamplerOutput(torch.empty(0, dtype=torch.int64, device=logits.device), None)
            return self._handle(req_ids, sample_rows, batch_rows, empty.sampled_token_ids,
                                start_host_copy(empty, extra))
        out = self._sample(logits, rows)
        self._note_penalized(batch_rows, out.sampled_token_ids)
        if not finishes_at_once:
            self.batch.num_pending[batch_rows] += 1
        num_logprobs = [row.params.logprobs for row in rows] if out.logprobs is not None else []
        return self._handle(req_ids, sample_rows, batch_rows, out.sampled_token_ids, start_host_copy(out, extra),
                            num_logprobs, is_pending=not finishes_at_once)

    def _note_penalized(self, batch_rows: np.ndarray, sampled: torch.Tensor) -> None:
        """Rows [S] with penalties keep their sampled ids [S] on the device (their seen-token state).
        Plain greedy rows have none: nothing to look up when every row is one."""
        if self.num_not_plain_greedy and (is_penalized := self.batch.has_penalties[batch_rows]).any():  # [S]
            if is_penalized.all():  # the common case: every row takes the checkpoint's penalty
                self.sampling.penalty_tokens.append_sampled(batch_rows, sampled)
                return
            penalized = np.flatnonzero(is_penalized)  # [S']
            # the index goes to the device first: a host index on a CUDA tensor waits for the whole step
            self.sampling.penalty_tokens.append_sampled(batch_rows[penalized],
                                                        sampled[on_device(penalized, sampled.device)])

    def _handle(self, req_ids: list[str], sample_rows: list[int], batch_rows: np.ndarray, sampled: torch.Tensor,
                copy: HostCopy, num_logprobs: list[int | None] | None = None, is_sync: bool = False,
                is_pending: bool = True) -> StepHandle:
        """is_pending: the rows' ids wait on the device until `finish` (their serials tell it which rows
        changed hands meanwhile)."""
        return StepHandle(req_ids, np.asarray(sample_rows, np.int64), sampled, copy, batch_rows,
                          self.batch.serial[batch_rows] if is_pending else None, num_logprobs or [], is_sync=is_sync)

    def _sample(self, logits: torch.Tensor, rows: list[CachedRequestState]) -> SamplerOutput:
        """Rank 0 samples; with tensor parallelism it broadcasts the ids to the other ranks, whose persistent
        batches need them (only rank 0 answers the engine, so they skip logprobs)."""
        if self.tp is None or self.tp.rank == 0:
            out = self.sampler(logits, self.sampling.metadata(rows, self.num_not_plain_greedy == 0))
            if self.tp is not None:
                self.tp.broadcast(out.sampled_token_ids)
            return out
        ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        return SamplerOutput(self.tp.broadcast(ids), None)

    @torch.inference_mode()
    def _verify_step(self, req_ids: list[str], inputs: StepInputs, batch_rows: np.ndarray, logits: torch.Tensor,
                     rows: list[CachedRequestState], sched_out: SchedulerOutput) -> StepHandle:
        """Drafts: verified on the host now (speculative steps run without overlap); the next drafts may be
        queued on the device first (Speculator.verify)."""
        drafts = [sched_out.scheduled_spec_tokens.get(row.req_id, []) for row in rows]
        step = None
        if len(rows) == len(req_ids):  # every row samples: the step holds only rows being verified
            step = VerifiedStep(inputs.input_ids, inputs.positions, inputs.attn.block_table)
        verified = self.speculator.verify(self.sampler, logits, rows, drafts, self.sampling.vocab_size, step,
                                          sched_out.use_speculation)
        handle = self._handle(req_ids, inputs.sample_rows, batch_rows, torch.empty(0), HostCopy({}), is_sync=True)
        handle.host_tokens, handle.host_logprobs = verified.token_ids, verified.logprobs
        handle.host_num_accepted = verified.num_accepted
        self.batch.num_pending[batch_rows] += 1
        return handle

    def finish_sampled(self, handle: StepHandle) -> np.ndarray:
        """`finish` for the first forward of a multi-step window (worker/decode_window.py, which makes one
        output of all its forwards): the sampled ids [S] only, appended to the batch."""
        sampled = self.step_output.take(handle)
        if handle is self.in_flight:
            self.in_flight = None  # launched to finish at once: no id was left pending
        return sampled

    def check_integrity(self) -> None:
        self.batch.check_integrity()
        assert set(self.batch.row_of) == set(self.states), "batch rows and states differ"
        if self.has_feature_reader:
            self.speculator.proposer.check_integrity(set(self.states))
        if self.lora is not None:
            self.lora.check_integrity([state.row for state in self.states.values()])
        assert self.prompt_scorers == {r for r, s in self.states.items() if s.params.prompt_logprobs is not None}
        assert self.num_not_plain_greedy == sum(not s.is_plain_greedy for s in self.states.values())
        if self.pooler is not None:
            self.pooler.check_integrity(self.states)
        for req_id, state in self.states.items():
            assert self.batch.row_of[req_id] == state.row and state.batch is self.batch, "a state's row moved"
            assert self.batch.has_penalties[state.row] == state.has_penalties, "a row's penalty flag is stale"
            assert self.batch.num_tokens[state.row] >= len(state.prompt_token_ids), "a row lost prompt tokens"
        if self.in_flight is None:
            assert not self.batch.num_pending[list(self.batch.row_of.values())].any(), "ids pending, no step"
            for state in filter(attrgetter("has_penalties"), self.states.values()):
                assert self.sampling.penalty_tokens.num_output[state.row] == state.num_output_tokens

