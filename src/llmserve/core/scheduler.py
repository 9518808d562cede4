"""The continuous-batching scheduler: one class, whose step takes one of three paths.

There is no prefill or decode phase: each step, every request's `num_computed_tokens` catches up with
its token count under one token budget (`max_num_batched_tokens`). Where every running request can decode
several tokens in a row, a multi-step window runs (core/decode_window.py); else running requests go first
(a long prompt chunked to what the budget leaves; plain decode rows in a tight loop, core/decode_rows.py),
then waiting ones in queue order. When blocks run out, the lowest-priority running request is preempted
by recompute (core/scheduler_preempt.py): its blocks are freed and it returns to the front of the waiting
queue, so no request is ever lost. `update_from_output` takes the step's ids in (core/scheduler_update.py).

Async scheduling (the engine schedules step N+1 while step N runs): a scheduled step that will sample
for a request leaves a placeholder on it (`num_placeholders`), which stands for the token until
`update_from_output` brings its id. Scheduling counts placeholders as tokens, so a decoding request
is scheduled again before its last token is known; without async scheduling a placeholder lives
within one step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from llmserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from llmserve.core.block_pool import KVBlock
from llmserve.core.decode_rows import has_all_tokens_in_flight, schedule_decode_rows
from llmserve.core.decode_window import schedule_window
from llmserve.core.grammar_wait import GrammarWaitList
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.kv_connector import KVConnector
from llmserve.core.kv_loading import KVLoadWaitList
from llmserve.core.kv_saving import KVSaves
from llmserve.core.lora_slots import (AdapterMemory, has_adapter_in_memory, is_held_behind, running_adapters,
                                      take_lora_slot)
from llmserve.core.partial_prefills import PartialPrefillLimits, StepPrefills, num_prompt_left
from llmserve.core.request import Request, RequestStatus
from llmserve.core.request_output import aborted_output
from llmserve.core.request_queue import make_queue
from llmserve.core.sched_output import CachedRequestData, ModelRunnerOutput, SchedulerOutput, new_request_data
from llmserve.core.scheduler_preempt import allocate_or_preempt
from llmserve.core.scheduler_update import update_from_output
from llmserve.core.sibling_holds import SiblingHolds
from llmserve.core.spec_stats import DraftBackoff, SpecDecodeCounter
from llmserve.messages import EngineCoreOutput, EngineCoreOutputs
from llmserve.structured.bitmask import StepGrammar

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, spec_config: SpeculativeConfig = SpeculativeConfig(),
                 group_windows: tuple[int, ...] = (0,), kv_connector: KVConnector | None = None,
                 max_loras: int = 0, lora_memory: AdapterMemory | None = None) -> None:
        """group_windows: each KV cache group's window (core/kv_cache_groups.py; 0: full attention).
        kv_connector: where blocks live below the device (core/kv_connector.py).
        max_loras: different LoRA adapters running at once (the runner's slots; 0: LoRA off).
        lora_memory: the runner's adapters in memory; a request starts once its adapter is there."""
        assert None not in (config.max_num_batched_tokens, config.max_num_seqs), \
            "resolve the device's defaults first (SchedulerConfig.for_device)"
        assert not spec_config.is_enabled or spec_config.speculative_max_batch is not None, \
            "resolve the device's speculation cap first (SpeculativeConfig.for_device)"
        self.config = config
        self.spec_config = spec_config
        self.num_lookahead = spec_config.num_lookahead_tokens
        self.spec_counter = SpecDecodeCounter(spec_config.num_speculative_tokens)
        self.draft_backoff = DraftBackoff(is_enabled=bool(config.async_scheduling)
                                          or (config.num_scheduler_steps or 1) > 1)
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.lora_memory = lora_memory
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 group_windows)
        assert kv_connector is None or cache_config.enable_prefix_caching, "a KV connector needs prefix caching"
        self.kv_connector = kv_connector
        self.kv_loading = None if kv_connector is None else KVLoadWaitList(self.kv, kv_connector)
        if kv_connector is not None:
            self.kv.saves = KVSaves(self.kv.pool)  # cached blocks let go of are copied out (core/kv_saving.py)
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.held_siblings = SiblingHolds()  # n > 1: later siblings wait for the first one's prompt blocks
        self.compiling = GrammarWaitList()  # structured requests whose grammar is not compiled yet
        self.num_structured = 0  # unfinished requests with a grammar
        self.num_streamed = 0  # unfinished requests whose tokens are read as they come (not is_final_only)
        self.finished_req_ids: set[str] = set()  # since the last step, for the runner
        self.seen_by_runner: set[str] = set()
        self.aborted_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.num_step_prompt_tokens = 0
        self.prefill_budget = 0  # prompt tokens left in the step being scheduled
        self.partial_limits = PartialPrefillLimits.resolve(
            config.max_num_partial_prefills, config.max_long_partial_prefills, config.long_prefill_token_threshold,
            max_model_len)
        self.step_prefills: StepPrefills | None = None  # this step's share of the budget (core/partial_prefills.py)
        # The step being scheduled: rows that `_advance_scheduled` moves on once all are scheduled (plain
        # decode rows move on as they are scheduled: core/decode_rows.py), and how many rows that made.
        self.rows_to_advance: list[Request] = []
        self.num_step_rows = 0

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        request.max_num_tokens = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        self.num_streamed += not request.is_final_only
        if request.grammar is not None:  # queued once compiled (at once on a cache hit): _admit_compiled
            self.num_structured += 1
            self.compiling.add(request)
            return
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if not (self.kv.enable_caching and self.held_siblings.hold(request, self.requests, self.compiling)):
            self.waiting.add(request)

    def _release_siblings(self, request: Request) -> None:
        for sibling in reversed(self.held_siblings.release(request)):
            self.waiting.add_front(sibling)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.WAITING_FOR_KV:  # its blocks are freed once the copy ends
                request.status = RequestStatus.FINISHED_ABORTED
                self.aborted_outputs.append(aborted_output(request))
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not self.held_siblings.remove(request) and not self.compiling.remove(request):
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self.aborted_outputs.append(aborted_output(request))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if status != RequestStatus.FINISHED_ABORTED:  # blocks a multi-step's last forwards filled
            self.kv.cache_full_blocks(request, request.num_computed_tokens)
        self.kv.free(request)
        self._release_siblings(request)
        self.num_structured -= request.grammar is not None
        self.num_streamed -= not request.is_final_only
        del self.requests[request.request_id]
        if request.request_id in self.seen_by_runner:
            self.seen_by_runner.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the queue; one that failed to compile ends (aborted)."""
        for request in self.compiling.ready():
            self.compiling.remove(request)
            if request.grammar.error is None:
                request.grammar.start()
                self._enqueue(request)
                continue
            logger.error("request %s: its grammar failed to compile: %s", request.request_id, request.grammar.error)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self.aborted_outputs.append(aborted_output(request))

    def _admit_loaded(self) -> None:
        """Requests whose prefix load ended go back to the front of the queue; one aborted meanwhile ends."""
        for request in reversed(self.kv_loading.take_done()):
            if request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
            else:
                self.waiting.add_front(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.aborted_outputs)

    def release_saved_blocks(self) -> bool:
        """Blocks ran short: rather than preempt, wait for the saves holding blocks to let go of them
        (core/kv_saving.py); whether any came back."""
        return self.kv.saves is not None and self.kv.saves.wait_to_release(self.kv_connector) > 0

    def wait_for_kv(self, timeout: float) -> bool:
        """Block until a load of the KV connector or the copy of a save ends, or `timeout` seconds pass (nothing
        to run); False (at once) when none is under way."""
        if len(self.kv_loading):
            self.kv_loading.wait(timeout)
            return True
        return self.kv.saves.wait(timeout)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._admit_compiled()
        if self.kv_loading is not None:
            self._admit_loaded()
            self.kv.saves.release_done()
        self.rows_to_advance, self.num_step_rows, self.num_step_prompt_tokens = [], 0, 0
        budget = self.config.max_num_batched_tokens
        self.prefill_budget = self._prefill_budget(budget)
        self.step_prefills = StepPrefills(self.partial_limits, budget, self.running, self.waiting) \
            if self.partial_limits.is_enabled else None
        if not self._schedule_window(out, budget):
            budget, has_preempted = self._schedule_running(out, budget, self.can_speculate())
            if not has_preempted:
                self._schedule_waiting(out, budget)
        out.use_speculation = self.can_speculate()
        self.draft_backoff.on_scheduled(out.num_steps)
        self._advance_scheduled(out)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        if self.kv_connector is not None:  # the blocks let go of while scheduling (preempted, out of a window)
            self.kv.saves.start(self.kv_connector)
        return out

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> EngineCoreOutputs:
        """The step's sampled ids in: stops, rejected drafts rolled back, outputs and stats
        (core/scheduler_update.py). The blocks finished requests let go of start their saves at once."""
        outputs = update_from_output(self, sched_out, runner_out)
        if self.kv_connector is not None:
            self.kv.saves.start(self.kv_connector)
        return outputs

    def take_aborted_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests aborted since the last step (a step with nothing finished returns them)."""
        outputs, self.aborted_outputs = self.aborted_outputs, []
        return outputs

    def _advance_scheduled(self, out: SchedulerOutput) -> None:
        """The step's requests count their scheduled tokens as computed; one that reaches its last token
        samples in this step (a placeholder stands for that token until its id is back)."""
        assert self.num_step_rows == len(out.num_scheduled_tokens), "step rows and scheduled tokens differ"
        num_prompt = 0
        for request in self.rows_to_advance:
            num = out.num_scheduled_tokens[request.request_id]
            start = request.num_computed_tokens
            end = request.num_computed_tokens = start + num
            if start < request.num_prompt_tokens:
                num_prompt += min(end, request.num_prompt_tokens) - start
            if end >= len(request.all_token_ids) + request.num_placeholders:
                request.num_placeholders += 1  # this step samples its next token
                if request.grammar is not None:  # its grammar masks the logits (the runner fills it)
                    out.grammar = out.grammar or StepGrammar(drafts=out.scheduled_spec_tokens)
                    out.grammar.add(request.request_id, request.grammar)
        self.num_step_prompt_tokens += num_prompt

    def _prefill_budget(self, budget: int) -> int:
        """Prompt tokens this step may compute: capped while some request decodes, so that a long
        prompt is spread over steps instead of stalling every decoding stream for one long step."""
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is None or not any(r.num_tokens_with_placeholders - r.num_computed_tokens == 1 for r in self.running):
            return budget
        return cap

    def _max_chunk(self, num_left: int) -> int:
        """The most tokens a prompt with `num_left` tokens left may compute in this step's share."""
        return num_left if self.step_prefills is None else self.step_prefills.max_chunk(num_left)

    def can_speculate(self) -> bool:
        """Whether the next step may schedule drafts: speculation pays off only while the batch is small
        (the rule: docs/speculative.md), and not while a run of steps that found no drafts backs off
        (core/spec_stats.DraftBackoff); the engine runs such steps without overlap."""
        return (self.spec_config.is_enabled and len(self.running) <= self.spec_config.speculative_max_batch
                and not self.draft_backoff.is_skipping)

    # ---- the three paths of a step: a window, the running requests, the waiting ones ---------------

    def _schedule_window(self, out: SchedulerOutput, budget: int) -> bool:
        """Every running request decodes several tokens, one a forward (core/decode_window.py), where a
        window can run; False (nothing scheduled) where none can."""
        return schedule_window(self, out, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int, can_speculate: bool) -> tuple[int, bool]:
        """The running requests in order: decode rows, prompt chunks, drafts, under the token budget,
        preempting where blocks run out. Returns the budget left and whether it preempted."""
        num_preemptions = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            num_decodes = schedule_decode_rows(self, out, i, budget)
            if num_decodes:
                i, budget = i + num_decodes, budget - num_decodes
                self.num_step_rows += num_decodes
                continue
            request = self.running[i]
            if has_all_tokens_in_flight(request):
                i += 1
                continue
            num_real = request.num_tokens_with_placeholders - request.num_computed_tokens
            drafts, request.spec_token_ids = (request.spec_token_ids if can_speculate else []), []
            if drafts and request.grammar is not None:  # only drafts the grammar allows are worth verifying
                drafts = drafts[:request.grammar.num_valid_drafts(drafts)]
            num_new = min(num_real + len(drafts), budget)
            if num_real > 1:  # a prompt chunk (or a preempted request's recompute)
                num_new = min(num_new, self.prefill_budget, self._max_chunk(num_real))
                if num_new == 0:
                    i += 1
                    continue
                self.prefill_budget -= num_new
            drafts = drafts[:max(0, num_new - num_real)]
            new_blocks, budget_back, num_before = allocate_or_preempt(self, out, request, num_new)
            budget, i = budget + budget_back, i - num_before
            if new_blocks is None:
                continue  # the request itself was preempted: running[i] is now the next one
            self.send_blocks(out, request, new_blocks)
            out.num_scheduled_tokens[request.request_id] = num_new
            self.rows_to_advance.append(request)
            self.num_step_rows += 1
            if drafts:
                out.scheduled_spec_tokens[request.request_id] = drafts
            budget -= num_new
            i += 1
        return budget, self.num_preemptions > num_preemptions

    def send_blocks(self, out: SchedulerOutput, request: Request, new_blocks: list[KVBlock]) -> None:
        """Tell the runner of the request's block changes (new blocks, or trimmed ones); nothing if none."""
        num_blocks = len(self.kv.req_to_blocks[request.request_id])
        num_old_blocks = num_blocks - len(new_blocks)
        if new_blocks or num_old_blocks != request.num_runner_blocks:
            out.cached_reqs.append(CachedRequestData(request.request_id, [b.block_id for b in new_blocks],
                                                     request.num_computed_tokens, num_old_blocks))
            request.num_runner_blocks = num_blocks

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not len(self.waiting):
            return
        adapters = running_adapters(self.running, self.max_loras)
        set_aside: list[Request] = []  # their adapter waits for a slot; they keep their place in the queue
        passed: list[Request] = []  # those and long prompts passed over (core/partial_prefills.py), in order
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.num_placeholders:
                break  # preempted while a step sampled for it: resume once that token is known
            if self.step_prefills is not None and not self.step_prefills.can_start(request):
                passed.append(self.waiting.pop())  # a long prompt beyond the long ones prefilling: shorter go first
                continue
            if is_held_behind(request, set_aside) or not take_lora_slot(request, adapters, self.max_loras) \
                    or not has_adapter_in_memory(request, self.lora_memory):  # its slot kept while it is read
                set_aside.append(self.waiting.pop())  # the ones behind it (running adapters, base) go first
                passed.append(set_aside[-1])
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if request.sampling_params.prompt_logprobs is not None:
                hits, num_hit_tokens = [], 0  # every prompt token is scored, so computed
            if self.kv_loading is not None and self.kv_loading.try_start(request, hits, num_hit_tokens):
                self.waiting.pop()  # waits for its prefix aside (WAITING_FOR_KV)
                continue
            num_new = request.num_tokens - num_hit_tokens
            limit = min(budget, self.prefill_budget)
            if limit == 0 or (not self.config.enable_chunked_prefill and num_new > limit):
                break
            num_new = min(num_new, limit, self._max_chunk(num_prompt_left(request)))
            if self.kv.allocate_slots(request, num_new, hits, self.num_lookahead) is None:
                break
            self.waiting.pop()
            if set_aside and request.lora is not None:
                set_aside[0].num_lora_passes += 1
            self.prefill_budget -= num_new
            if self.step_prefills is not None:
                self.step_prefills.on_started(num_prompt_left(request))
            self._start_running(request, num_hit_tokens)
            out.new_reqs.append(new_request_data(request, self.kv.get_block_ids(request.request_id)))
            out.num_scheduled_tokens[request.request_id] = num_new
            self.rows_to_advance.append(request)
            self.num_step_rows += 1
            budget -= num_new
        for request in reversed(passed):
            self.waiting.add_front(request)

    def _start_running(self, request: Request, num_hit_tokens: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
            request.scheduled_time = time.time()
        self.running.append(request)
        self.seen_by_runner.add(request.request_id)
        if request.sampling_params.speculative:
            self.draft_backoff.reset()  # a new row to look for drafts in

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert request.request_id in self.requests
            assert request.num_computed_tokens <= request.num_tokens_with_placeholders, \
                "computed past the tokens (drafts not rolled back)"
            self.kv.check_request(request)
        assert self.num_structured == sum(r.grammar is not None for r in self.requests.values())
        assert self.num_streamed == sum(not r.is_final_only for r in self.requests.values())
        assert all(r.request_id in self.requests for r in self.compiling.requests)
        owners = set(self.kv.req_to_blocks)
        loading = set(self.kv_loading.loads) if self.kv_loading is not None else set()
        assert owners <= {r.request_id for r in self.running} | loading, "a non-running request holds blocks"
        if self.kv_loading is not None:
            self.kv_loading.check_integrity()
