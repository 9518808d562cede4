"""The scheduler's second half: `update_from_output` takes a step's sampled ids in (stops, the one
rollback of rejected drafts, the next drafts kept) and reports the step's outputs and stats. A plain
decode step (one token a row, nothing else asked for) takes a tight loop; everything else the general
one. `Scheduler` (core/scheduler.py) inherits it and owns the state it reads."""

from __future__ import annotations

import time

from llmserve.config import SpeculativeConfig
from llmserve.core.grammar_wait import GrammarWaitList
from llmserve.core.kv_loading import KVLoadWaitList
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.request import Request, RequestStatus
from llmserve.core.request_queue import FCFSQueue, PriorityQueue
from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.core.spec_stats import SpecDecodeCounter
from llmserve.core.stop_rules import check_stop, follow_grammar
from llmserve.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats


class OutputUpdate:
    """What the update reads of the scheduler's state (set by `Scheduler.__init__`); it also calls the
    scheduler's `_finish` and `_release_siblings`."""

    kv: KVCacheManager
    spec_config: SpeculativeConfig
    spec_counter: SpecDecodeCounter
    num_lookahead: int
    max_model_len: int
    requests: dict[str, Request]
    running: list[Request]
    waiting: FCFSQueue | PriorityQueue
    compiling: GrammarWaitList
    kv_loading: KVLoadWaitList | None
    held_siblings: dict[str, list[Request]]
    aborted_outputs: list[EngineCoreOutput]
    num_preemptions: int
    num_step_prompt_tokens: int

    def take_aborted_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests aborted since the last step (a step with nothing finished returns them)."""
        outputs, self.aborted_outputs = self.aborted_outputs, []
        return outputs

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs = self.take_aborted_outputs()
        now = time.time()
        if runner_out.pooled is not None:
            self._update_pooled(runner_out, outputs, now)
            return EngineCoreOutputs(outputs=outputs, stats=self._stats(sched_out, 0))
        if sched_out.num_steps > 1:
            num_generated = self._update_window(sched_out, runner_out, outputs, now)
            return EngineCoreOutputs(outputs=outputs, stats=self._stats(sched_out, num_generated))
        if self._is_plain_decode(sched_out, runner_out):
            num_generated = self._update_plain(runner_out, outputs, now)
            return EngineCoreOutputs(outputs=outputs, stats=self._stats(sched_out, num_generated))
        num_generated = 0
        logprobs = runner_out.logprobs or [None] * len(runner_out.req_ids)
        proposals = runner_out.spec_token_ids or [None] * len(runner_out.req_ids)
        prompt_logprobs = runner_out.prompt_logprobs or [None] * len(runner_out.req_ids)
        accepted = runner_out.num_accepted or [0] * len(runner_out.req_ids)
        for req_id, token_ids, row_logprobs, drafts, row_prompt, num_accepted in zip(
                runner_out.req_ids, runner_out.sampled_token_ids, logprobs, proposals, prompt_logprobs, accepted):
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted during the step
            if self.held_siblings and request.num_computed_tokens >= request.num_prompt_tokens:
                self._release_siblings(request)
            if not token_ids:
                if row_prompt is not None:  # a prefill chunk: only its prompt logprobs to report
                    outputs.append(EngineCoreOutput(req_id, [], prompt_logprobs=row_prompt))
                continue
            request.num_placeholders -= 1
            self._reject_drafts(request, sched_out.scheduled_spec_tokens.get(req_id), num_accepted)
            num_generated += len(token_ids)
            out = self._append_tokens(request, token_ids, row_logprobs, now)
            if out is not None:
                out.prompt_logprobs = row_prompt
                outputs.append(out)
            if self.spec_config.is_enabled and not request.is_finished:
                self._store_drafts(request, drafts or [])
        if sched_out.use_speculation:
            self.draft_backoff.observe(sum(bool(d) for d in proposals))
        return EngineCoreOutputs(outputs=outputs, stats=self._stats(sched_out, num_generated))

    def _update_pooled(self, runner_out: ModelRunnerOutput, outputs: list[EngineCoreOutput], now: float) -> None:
        """update_from_output for a pooling step: a row whose prompt ended has its vector, and ends (stop)."""
        for req_id, pooled in zip(runner_out.req_ids, runner_out.pooled):
            request = self.requests.get(req_id)
            if request is None or pooled is None:
                continue  # aborted during the step, or a prompt chunk
            request.num_placeholders -= 1
            self.running.remove(request)
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.STOP,
                                            num_cached_tokens=max(request.num_cached_tokens, 0),
                                            scheduled_time=request.scheduled_time, first_token_time=now,
                                            pooled=pooled))

    def _is_plain_decode(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> bool:
        """The step has only sampled ids to take in: no logprobs, drafts or siblings waiting on a prompt,
        and it did not look for drafts (the back-off counts the steps that found none)."""
        return not (runner_out.logprobs or runner_out.prompt_logprobs or runner_out.spec_token_ids
                    or sched_out.scheduled_spec_tokens or sched_out.use_speculation or self.held_siblings)

    def _update_plain(self, runner_out: ModelRunnerOutput, outputs: list[EngineCoreOutput], now: float) -> int:
        """update_from_output for a plain step (`_is_plain_decode`): a row that samples one token and
        stops on nothing takes it in a tight loop; the others go through `_append_tokens`. Returns the
        number of tokens generated."""
        num_generated = 0
        for req_id, token_ids in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or not token_ids:
                continue  # aborted during the step, or a prompt chunk
            request.num_placeholders -= 1
            num_generated += len(token_ids)
            num_tokens = len(request.all_token_ids) + 1
            if (len(token_ids) == 1 and token_ids[0] not in request.any_stop_token_ids
                    and num_tokens < request.max_num_tokens
                    and request.grammar is None and request.first_token_time is not None):
                request.all_token_ids.append(token_ids[0])
                if not request.is_final_only:
                    outputs.append(EngineCoreOutput(req_id, token_ids,
                                                    num_cached_tokens=max(request.num_cached_tokens, 0)))
                continue
            out = self._append_tokens(request, token_ids, None, now)
            if out is not None:
                outputs.append(out)
        return num_generated

    def _update_window(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
                       outputs: list[EngineCoreOutput], now: float) -> int:
        """update_from_output for a multi-step (core/decode_steps.py), whose rows report only their final
        output, follow no grammar and have their first token: a row whose ids stop on nothing only takes
        them in; the others go through `_append_tokens`. A window the runner ended early gave a row fewer
        ids than forwards counted: the rest is rolled back. Returns the number of tokens generated."""
        num_generated = 0
        scheduled = sched_out.num_scheduled_tokens
        for req_id, token_ids in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted during the step
            num_generated += len(token_ids)
            request.num_placeholders = 0
            request.num_computed_tokens -= scheduled[req_id] - len(token_ids)  # forwards the window did not run
            if request.any_stop_token_ids.isdisjoint(token_ids):  # (its count stops at max_num_tokens)
                known = request.all_token_ids
                known += token_ids
                if len(known) < request.max_num_tokens:
                    continue
                out = self._append_tokens(request, [], None, now, RequestStatus.FINISHED_LENGTH)
            else:  # a stop id: taken in one by one (min_tokens)
                out = self._append_tokens(request, token_ids, None, now)
            if out is not None:
                outputs.append(out)  # it ended
        return num_generated

    def _reject_drafts(self, request: Request, drafts: list[int] | None, num_accepted: int) -> None:
        """Roll `num_computed_tokens` back over the drafts the target rejected (their KV is overwritten;
        the runner takes the count from the next step's diff): the one rollback of a speculative step."""
        if not drafts:
            return
        assert 0 <= num_accepted <= len(drafts), "more drafts accepted than scheduled"
        if num_accepted < len(drafts):
            request.num_computed_tokens -= len(drafts) - num_accepted
            request.num_runner_blocks = -1  # the next step sends the runner this row's diff (`_send_blocks`)
        self.spec_counter.observe(len(drafts), num_accepted)

    def _store_drafts(self, request: Request, drafts: list[int]) -> None:
        """Keep the proposals for the next step (never past max_tokens) and give back the blocks that
        only rejected drafts used."""
        room = max(0, request.max_tokens - request.num_output_tokens - 1)
        request.spec_token_ids = drafts[:room]
        self.kv.trim(request, request.num_tokens + len(request.spec_token_ids) + self.num_lookahead)

    def _append_tokens(self, request: Request, token_ids: list[int], row_logprobs, now: float,
                       status: RequestStatus | None = None) -> EngineCoreOutput | None:
        """The row's ids in, up to a stop -> its output (None: a final-only request that goes on). `status`:
        the stop its ids already reached (taken in by the caller)."""
        accepted: list[int] = []
        for token_id in token_ids:
            request.append_output_token(token_id)
            accepted.append(token_id)
            status = check_stop(request, self.max_model_len)
            if status is None and request.grammar is not None:
                status = follow_grammar(request, token_id)
            if status is not None:
                break
        out = EngineCoreOutput(request.request_id, accepted, new_logprobs=row_logprobs,
                               num_cached_tokens=max(request.num_cached_tokens, 0))
        if request.first_token_time is None:
            request.first_token_time = now
            out.scheduled_time = request.scheduled_time
            out.first_token_time = now
        if status is not None:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:  # preempted while its last step was in flight
                self.waiting.remove(request)
            self._finish(request, status)
            out.finish_reason = status.finish_reason()
            out.stop_reason = request.stop_reason
        if request.is_final_only:
            return None if status is None else _as_final(out, request)
        return out

    def _stats(self, sched_out: SchedulerOutput, num_generated: int) -> SchedulerStats:
        queries, hits = self.kv.take_prefix_stats()
        num_preemptions, self.num_preemptions = self.num_preemptions, 0
        return SchedulerStats(num_running=len(self.running),
                              num_waiting=len(self.waiting) + self._num_held() + len(self.compiling)
                              + len(self.kv_loading or ()),
                              kv_cache_usage=self.kv.usage(), num_kv_blocks=self.kv.pool.num_usable_blocks,
                              num_free_kv_blocks=self.kv.pool.get_num_free_blocks(), prefix_cache_queries=queries,
                              prefix_cache_hits=hits, num_preemptions=num_preemptions,
                              num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
                              num_prompt_tokens=self.num_step_prompt_tokens, num_generation_tokens=num_generated,
                              timestamp=time.time(), spec=self.spec_counter.take())

    def _num_held(self) -> int:
        return sum(len(s) for s in self.held_siblings.values())


def _as_final(out: EngineCoreOutput, request: Request) -> EngineCoreOutput:
    """A final-only request's one output: all its ids and its times (no earlier output carried them)."""
    out.new_token_ids = request.output_token_ids
    out.scheduled_time = request.scheduled_time
    out.first_token_time = request.first_token_time
    return out


def aborted_output(request: Request) -> EngineCoreOutput:
    """The output of a request ended by an abort (its ids too if it is final-only)."""
    out = EngineCoreOutput(request.request_id, [], finish_reason=request.status.finish_reason())
    return _as_final(out, request) if request.is_final_only else out
