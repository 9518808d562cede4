"""The front's output side: engine outputs -> RequestOutput per user request.

Detokenizes incrementally, applies stop strings (a match finishes the sequence here and asks the core
to abort it), gathers the n sequences of a request, and hands results to a collector (async serving)
or returns them (offline). In delta mode each RequestOutput holds only what is new.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.messages import EngineCoreOutput, FinishReason, PromptLogprobs
from llmserve.engine.processor import child_request_id
from llmserve.engine.stop_strings import check_stop_strings, hold_back
from llmserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from llmserve.sampling_params import SamplingParams


class OutputCollector(Protocol):
    def put(self, output: RequestOutput) -> None: ...


def is_text_deferred(params: SamplingParams, collector: OutputCollector | None, is_delta: bool) -> bool:
    """Only the final text is ever read (offline, not streamed, no stop string to look for): it is decoded
    once, when the sequence finishes, not token by token."""
    return collector is None and not is_delta and not params.stop


def reads_final_only(params: SamplingParams, collector: OutputCollector | None, is_delta: bool) -> bool:
    """Only the finished sequence is read (deferred text, no logprobs): the core may report it once, at its
    end (EngineCoreRequest.is_final_only)."""
    return (is_text_deferred(params, collector, is_delta) and params.logprobs is None
            and params.prompt_logprobs is None)


@dataclass
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    text: str = ""  # final text so far (stop string cut off once matched)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_chars: int = 0  # delta mode: what earlier outputs already carried
    num_sent_tokens: int = 0
    is_final_sent: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, SequenceState]  # engine request id -> sequence
    is_delta: bool
    collector: OutputCollector | None
    arrival_time: float
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    is_text_deferred: bool = False  # set on creation
    prompt_logprobs: list[TokenLogprob | None] | None = None  # prompt_logprobs=k: filled as chunks run
    is_prompt_logprobs_sent: bool = False
    pooled: bytes | None = None  # a pooling request's vector, once its prompt ran

    def __post_init__(self) -> None:
        self.is_text_deferred = is_text_deferred(self.params, self.collector, self.is_delta)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    def add_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        """A chunk's scores (a recompute after preemption rewrites the same values)."""
        for i, lp in enumerate(scored.logprobs):
            self.prompt_logprobs[scored.start + i] = _token_logprob(lp)

    @property
    def is_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]  # for requests without a collector
    reqs_to_abort: list[str]  # engine request ids that a stop string finished


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        """stream_interval: a streamed (delta) request gets an output once a sequence has this many
        unsent tokens, on its first token, and when a sequence finishes."""
        assert stream_interval >= 1
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}
        self.engine_to_seq: dict[str, tuple[RequestState, SequenceState]] = {}  # engine request id -> its sequence

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    collector: OutputCollector | None = None, is_delta: bool = False,
                    arrival_time: float | None = None) -> None:
        engine_ids = [request_id] if params.n == 1 else [child_request_id(request_id, i) for i in range(params.n)]
        sequences = {eid: SequenceState(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                                   params.skip_special_tokens),
                                        logprobs=[] if params.logprobs is not None else None)
                     for i, eid in enumerate(engine_ids)}
        state = RequestState(request_id, prompt, prompt_token_ids, params, sequences, is_delta, collector,
                             arrival_time or time.time())
        self.requests[request_id] = state
        for eid in engine_ids:
            self.engine_to_seq[eid] = (state, sequences[eid])

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids the core must abort."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for eid in state.sequences:
            self.engine_to_seq.pop(eid, None)
        return [eid for eid, seq in state.sequences.items() if seq.finish_reason is None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_engine_requests(self) -> int:
        """Engine requests this front still waits on (n > 1 counts n)."""
        return len(self.engine_to_seq)

    def unfinished_engine_ids(self) -> list[str]:
        return [eid for state in self.requests.values() for eid, seq in state.sequences.items()
                if seq.finish_reason is None]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs([], [])
        touched: dict[str, RequestState] = {}
        for out in outputs:
            entry = self.engine_to_seq.get(out.request_id)
            if entry is None:
                continue  # already finished here (stop string) or aborted
            state, seq = entry
            if (state.is_text_deferred and out.finish_reason is None and out.first_token_time is None
                    and out.prompt_logprobs is None):
                seq.token_ids += out.new_token_ids  # the common offline step: tokens only
                if out.new_logprobs and seq.logprobs is not None:
                    seq.logprobs.extend(_token_logprob(lp) for lp in out.new_logprobs)
                continue
            if self._update_sequence(state, seq, out):
                result.reqs_to_abort.append(out.request_id)
            touched[state.request_id] = state
        for state in touched.values():
            self._emit(state, result)
        return result

    def _update_sequence(self, state: RequestState, seq: SequenceState, out: EngineCoreOutput) -> bool:
        """Apply one engine output; True if a stop string finished the sequence here."""
        if seq.finish_reason is not None:
            return False  # a stop string ended it; the core's abort is on its way
        _record_times(state, out)
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.pooled is not None:
            state.pooled = out.pooled
        if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.add_prompt_logprobs(out.prompt_logprobs)
        seq.token_ids.extend(out.new_token_ids)
        if seq.logprobs is not None and out.new_logprobs:
            seq.logprobs.extend(_token_logprob(lp) for lp in out.new_logprobs)
        if state.is_text_deferred:
            if out.finish_reason is not None:
                seq.text = seq.detokenizer.decode_all(_text_token_ids(state.params, seq.token_ids, out))
                seq.finish_reason = str(out.finish_reason)
                seq.stop_reason = out.stop_reason
            return False
        text_ids = _text_token_ids(state.params, out.new_token_ids, out)
        new_text = seq.detokenizer.add(text_ids) if text_ids else ""
        seq.text += new_text
        stops = state.params.stop
        if stops and new_text:
            match = check_stop_strings(seq.text, len(new_text), stops, state.params.include_stop_str_in_output)
            if match is not None:
                seq.stop_reason, cut = match
                seq.text = seq.text[:cut]
                seq.finish_reason = str(FinishReason.STOP)
                return out.finish_reason is None
        if out.finish_reason is not None:
            seq.text += seq.detokenizer.flush()
            seq.finish_reason = str(out.finish_reason)
            seq.stop_reason = out.stop_reason
        return False

    def _emit(self, state: RequestState, result: ProcessedOutputs) -> None:
        finished = state.is_finished
        if finished:
            state.metrics["finished_time"] = time.time()
            self.abort_request(state.request_id)  # forget it (nothing left to abort in the core)
        if not state.is_delta and not finished and state.collector is None:
            return  # offline, non-streaming: only the final output matters
        if state.is_delta and not finished and not self._is_stream_due(state):
            return
        output = self._request_output(state, finished)
        if output is None:
            return
        if state.collector is not None:
            state.collector.put(output)
        else:
            result.request_outputs.append(output)

    def _is_stream_due(self, state: RequestState) -> bool:
        for seq in state.sequences.values():
            if seq.is_final_sent:
                continue
            num_unsent = len(seq.token_ids) - seq.num_sent_tokens
            if seq.num_sent_tokens == 0 or num_unsent >= self.stream_interval or seq.finish_reason is not None:
                return True
        return False

    def _request_output(self, state: RequestState, finished: bool) -> RequestOutput | None:
        completions = []
        for seq in state.sequences.values():
            completion = _delta(seq, state.params.stop) if state.is_delta else _full(seq)
            if completion is not None:
                completions.append(completion)
        if state.is_delta and not completions and not finished:
            return None
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not (state.is_delta and state.is_prompt_logprobs_sent):
            prompt_logprobs = list(state.prompt_logprobs)
            state.is_prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
                             state.num_cached_tokens, dict(state.metrics), prompt_logprobs, state.pooled)


def _full(seq: SequenceState) -> CompletionOutput:
    return CompletionOutput(seq.index, seq.text, list(seq.token_ids),
                            list(seq.logprobs) if seq.logprobs is not None else None,
                            seq.finish_reason, seq.stop_reason)


def _delta(seq: SequenceState, stops: list[str] | None) -> CompletionOutput | None:
    """What is new since the last output; text that may be the start of a stop string is held back."""
    if seq.is_final_sent:
        return None
    is_done = seq.finish_reason is not None
    end = len(seq.text)
    if stops and not is_done:
        end = max(seq.num_sent_chars, end - hold_back(seq.text, stops))
    new_tokens = seq.token_ids[seq.num_sent_tokens:]
    if not is_done and end == seq.num_sent_chars and not new_tokens:
        return None
    completion = CompletionOutput(seq.index, seq.text[seq.num_sent_chars:end], new_tokens,
                                  seq.logprobs[seq.num_sent_tokens:] if seq.logprobs is not None else None,
                                  seq.finish_reason, seq.stop_reason)
    seq.num_sent_chars = end
    seq.num_sent_tokens = len(seq.token_ids)
    seq.is_final_sent = is_done
    return completion


def _text_token_ids(params: SamplingParams, token_ids: list[int], out: EngineCoreOutput) -> list[int]:
    """The ids whose text the output carries: a sequence the core stopped (EOS, a stop token id, a grammar's
    end) ends in that stop token, whose text is left out unless include_stop_str_in_output, as in vLLM (its id
    stays in token_ids)."""
    if out.finish_reason != FinishReason.STOP or not out.new_token_ids or params.include_stop_str_in_output:
        return token_ids
    return token_ids[:-1]


def _token_logprob(lp) -> TokenLogprob:
    return TokenLogprob(lp.token_ids[0], lp.logprobs[0], lp.sampled_rank,
                        list(zip(lp.token_ids[1:], lp.logprobs[1:])))


def _record_times(state: RequestState, out: EngineCoreOutput) -> None:
    if out.first_token_time is not None and "first_token_time" not in state.metrics:
        state.metrics["first_token_time"] = out.first_token_time
        state.metrics["scheduled_time"] = out.scheduled_time or out.first_token_time
        state.metrics["arrival_time"] = state.arrival_time
