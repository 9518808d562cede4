"""AsyncLLM: the serving front of the engine (asyncio), over the engine-core process.

`generate()` is a per-request async generator of delta RequestOutputs; it owns the request's clean-up:
when it is closed or cancelled before the request finished (client gone, shutdown), it aborts the
request in the core, which frees its KV blocks within one step.

A step's outputs are processed (detokenized, stop strings, handed to the requests) in chunks of
OUTPUT_CHUNK_SIZE requests with a turn of the event loop between chunks, as vLLM does: a step that
ends hundreds of requests does not hold up every stream, /health and new requests until it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from llmserve.config import EngineConfig, KVTransferConfig
from llmserve.engine.core_client import EngineCoreClient, EngineDeadError
from llmserve.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.processor import Processor
from llmserve.lora_request import LoRARequest
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.model.loader import ModelInfo

__all__ = ["AsyncLLM", "EngineDeadError", "RequestTimeoutError", "StatLogger", "TokensPrompt", "WrongRunnerError",
           "merge_outputs"]

logger = logging.getLogger("llmserve.engine.async_llm")

OUTPUT_CHUNK_SIZE = 128  # requests' outputs processed in one turn of the event loop


class RequestTimeoutError(Exception):
    """The request ran longer than the front's request timeout; it was aborted (its KV blocks freed)."""


class WrongRunnerError(ValueError):
    """A request the engine's runner does not serve (generation on --runner pooling, or embeddings on
    --runner generate): a user error about the model served."""

    param = "model"


@dataclass
class TokensPrompt:
    """A prompt the caller tokenized already (e.g. a rendered chat template); `text` for echo."""

    token_ids: list[int]
    text: str | None = None


class StatLogger(Protocol):
    """What the front reports for metrics (the server's Prometheus metrics implement it)."""

    def on_request_added(self, request: EngineCoreRequest) -> None: ...

    def on_engine_outputs(self, outputs: EngineCoreOutputs) -> None: ...

    def on_finished_by_stop_string(self, engine_request_ids: list[str]) -> None: ...


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold a later delta into an earlier one (a slow reader gets one output with both)."""
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        logprobs = prev.logprobs + c.logprobs if prev.logprobs is not None and c.logprobs is not None else (
            prev.logprobs if c.logprobs is None else c.logprobs)
        by_index[c.index] = CompletionOutput(c.index, prev.text + c.text, prev.token_ids + c.token_ids, logprobs,
                                             c.finish_reason, c.stop_reason)
    return RequestOutput(new.request_id, new.prompt, new.prompt_token_ids,
                         [by_index[i] for i in sorted(by_index)], new.finished, new.num_cached_tokens, new.metrics,
                         old.prompt_logprobs if new.prompt_logprobs is None else new.prompt_logprobs,
                         old.pooled if new.pooled is None else new.pooled)


class RequestOutputCollector:
    """One request's mailbox between the output handler and its generator; never blocks the producer."""

    def __init__(self) -> None:
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self.output = output if self.output is None else merge_outputs(self.output, output)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None:
            if self.error is not None:
                raise self.error
            self.ready.clear()
            await self.ready.wait()
        output, self.output = self.output, None
        return output


class AsyncLLM:
    def __init__(self, client: EngineCoreClient, tokenizer, generation_defaults: dict,
                 stat_logger: StatLogger | None = None, stream_interval: int = 1,
                 request_timeout: float | None = None) -> None:
        """request_timeout: seconds a request may run before it is aborted (None: no limit)."""
        self.client = client
        self.request_timeout = request_timeout
        self.model_info: ModelInfo = client.model_info
        self.tokenizer = tokenizer
        info = self.model_info
        self.processor = Processor(tokenizer, info.vocab_size, info.max_model_len, info.eos_token_ids,
                                   generation_defaults)
        self.output_processor = OutputProcessor(tokenizer, stream_interval)
        self.stat_logger = stat_logger
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.last_stats: SchedulerStats | None = None
        self.kv_transfer = KVTransferConfig()  # the engine's tiers and disaggregation role (from_config sets it)
        self.busy_since = time.monotonic()
        self.dead_callbacks: list[Callable[[str], None]] = []
        client.on_outputs = self._on_outputs
        client.on_dead = self._on_dead

    @property
    def is_pooling(self) -> bool:
        """An embedding engine (--runner pooling): it pools prompts (`embed`) and generates nothing."""
        return self.model_info.pooler is not None

    def check_runner(self, is_pooling: bool) -> None:
        """ValueError unless the engine's runner serves this kind of request."""
        if is_pooling and not self.is_pooling:
            raise WrongRunnerError("this server runs a generation model (--runner generate): embeddings need an "
                                   "embedding model served with --runner pooling")
        if not is_pooling and self.is_pooling:
            raise WrongRunnerError("this server runs an embedding model (--runner pooling): it serves "
                                   "/v1/embeddings only; text generation needs --runner generate")

    @classmethod
    async def from_config(cls, config: EngineConfig, *, startup_timeout: float = 600.0,
                          stat_logger: StatLogger | None = None, stream_interval: int = 1,
                          request_timeout: float | None = None) -> AsyncLLM:
        # The tokenizer loads while the engine process starts, when its location is known up front.
        source = config.model.tokenizer or config.model.model
        early = None
        if source is not None:
            early = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, source, config.model.revision))
        try:
            client = await EngineCoreClient.start(config, startup_timeout)
        except BaseException:
            if early is not None:
                await asyncio.gather(early, return_exceptions=True)
            raise
        try:
            from llmserve.model.loader import load_generation_defaults

            path = client.model_info.path
            tokenizer = await (early if early is not None else asyncio.to_thread(_load_tokenizer, path, None))
            llm = cls(client, tokenizer, load_generation_defaults(path), stat_logger, stream_interval,
                      request_timeout)
            llm.kv_transfer = config.kv_transfer
            if config.kv_transfer.disaggregation_mode == "decode":  # the port bound (0 asks for any free one)
                llm.kv_transfer = replace(config.kv_transfer, disaggregation_kv_port=client.kv_port)
            return llm
        except BaseException:
            await client.shutdown()
            raise

    # ---- requests ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.processor.tokenize(text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.processor.tokenize(token_ids)  # checks the ids are in the vocabulary
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        return self.processor.default_sampling_params(**overrides)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Validate before answering (e.g. before an SSE stream starts): ValueError naming the problem."""
        self.check_runner(is_pooling=False)
        params.validate()
        params.validate_for_vocab(self.model_info.vocab_size)
        self.processor.check_length(num_prompt_tokens, params)
        self._check_kv_transfer(params)

    def _check_kv_transfer(self, params: SamplingParams) -> None:
        if params.kv_transfer_params is not None and self.kv_transfer.disaggregation_mode != "prefill":
            raise ValueError("kv_transfer_params: this server is not a prefill server (--disaggregation-mode "
                             f"{self.kv_transfer.disaggregation_mode}): send the request without it")

    async def generate(self, prompt: str | list[int] | TokensPrompt, params: SamplingParams, request_id: str,
                       priority: int = 0, lora: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request until it finishes (EngineDeadError if the engine dies,
        RequestTimeoutError when it runs past the request timeout)."""
        self.check_health()
        self.check_runner(is_pooling=False)
        text, token_ids = self._tokenize_prompt(prompt)
        self._check_new_id(request_id)
        self._check_kv_transfer(params)
        requests = self.processor.process(request_id, token_ids, params, priority, lora=lora)
        collector = RequestOutputCollector()
        self._add(request_id, text, token_ids, params, requests, collector)
        timer = self._start_timer(collector)
        is_finished = False
        try:
            while not is_finished:
                output = await collector.get()
                is_finished = output.finished
                yield output
        finally:
            self._end(request_id, timer, is_finished)

    async def embed(self, prompt: list[int] | TokensPrompt, request_id: str, priority: int = 0) -> RequestOutput:
        """One prompt pooled into one vector (--runner pooling): its final RequestOutput, whose `pooled` holds
        it. Run through the scheduler as prompt-only work (chunked like any prompt; no KV kept after)."""
        self.check_health()
        self.check_runner(is_pooling=True)
        _, token_ids = self._tokenize_prompt(prompt)
        self._check_new_id(request_id)
        request = self.processor.process_pooling(request_id, token_ids, priority)
        collector = RequestOutputCollector()
        self._add(request_id, None, token_ids, request.sampling_params, [request], collector)
        timer = self._start_timer(collector)
        final = None
        try:
            while final is None or not final.finished:
                output = await collector.get()
                final = output if final is None else merge_outputs(final, output)
            return final
        finally:
            self._end(request_id, timer, final is not None and final.finished)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.collectors:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _end(self, request_id: str, timer: asyncio.TimerHandle | None, is_finished: bool) -> None:
        """A request's generator is done: its timer stopped, its mailbox gone, the request aborted unless it ended."""
        if timer is not None:
            timer.cancel()
        self.collectors.pop(request_id, None)
        if not is_finished:
            self.abort(request_id)

    def _start_timer(self, collector: RequestOutputCollector) -> asyncio.TimerHandle | None:
        """Fail the request's generator once it ran for the request timeout (it then aborts the request)."""
        if self.request_timeout is None:
            return None
        error = RequestTimeoutError(f"the request ran longer than the server's request timeout "
                                    f"({self.request_timeout:g} s) and was aborted")
        return asyncio.get_running_loop().call_later(self.request_timeout, collector.fail, error)

    def _tokenize_prompt(self, prompt: str | list[int] | TokensPrompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, TokensPrompt):
            return prompt.text, self.processor.tokenize(prompt.token_ids)
        if isinstance(prompt, str):
            return prompt, self.processor.tokenize(prompt)
        return None, self.processor.tokenize(prompt)

    def _add(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
             requests: list[EngineCoreRequest], collector: RequestOutputCollector) -> None:
        if not self.output_processor.has_unfinished_requests():
            self.busy_since = time.monotonic()
        self.output_processor.add_request(request_id, text, token_ids, params, collector, is_delta=True,
                                          arrival_time=requests[0].arrival_time)
        self.collectors[request_id] = collector
        try:
            for request in requests:
                self.client.add_request(request)
                if self.stat_logger is not None:
                    self.stat_logger.on_request_added(request)
        except BaseException:
            self.collectors.pop(request_id, None)
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Forget the request here and abort what is left of it in the core."""
        engine_ids = self.output_processor.abort_request(request_id)
        if engine_ids and not self.client.is_dead:
            self.client.abort_requests(engine_ids)

    def abort_all(self) -> int:
        """Abort every request in flight (their generators get a final output with finish_reason abort)."""
        request_ids = list(self.output_processor.requests)
        engine_ids = self.output_processor.unfinished_engine_ids()
        if engine_ids and not self.client.is_dead:
            self.client.abort_requests(engine_ids)
        return len(request_ids)

    @property
    def num_unfinished_requests(self) -> int:
        """Engine requests in flight (n > 1 counts its n sequences)."""
        return self.output_processor.num_engine_requests

    # ---- outputs and failure ----------------------------------------------------------------------

    async def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.stats is not None:
            self.last_stats = outputs.stats
        for i, chunk in enumerate(output_chunks(outputs, OUTPUT_CHUNK_SIZE)):
            if i:
                await asyncio.sleep(0)  # one turn of the event loop between chunks
            self._process_chunk(chunk)

    def _process_chunk(self, outputs: EngineCoreOutputs) -> None:
        if self.stat_logger is not None:
            self.stat_logger.on_engine_outputs(outputs)
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
            if self.stat_logger is not None:
                self.stat_logger.on_finished_by_stop_string(processed.reqs_to_abort)

    def fail_all(self, error: BaseException) -> int:
        """End every open request's generator with `error` (it then aborts its request); how many."""
        for collector in self.collectors.values():
            collector.fail(error)
        return len(self.collectors)

    def _on_dead(self, reason: str) -> None:
        self.fail_all(EngineDeadError(reason))
        for callback in self.dead_callbacks:
            callback(reason)

    # ---- health, utilities, shutdown --------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    def is_making_progress(self, stall_timeout: float) -> bool:
        """Alive, and either idle or heard from within `stall_timeout` seconds."""
        if self.client.is_dead:
            return False
        if not self.output_processor.has_unfinished_requests():
            return True
        last = max(self.client.last_output_time, self.busy_since)
        return time.monotonic() - last < stall_timeout

    def check_health(self) -> None:
        if self.client.is_dead:
            raise EngineDeadError(self.client.dead_reason)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache"))

    async def check_integrity(self) -> None:
        await self.client.call_utility("check_integrity")

    async def shutdown(self, timeout: float = 5.0) -> None:
        await self.client.shutdown(timeout)


def output_chunks(outputs: EngineCoreOutputs, size: int) -> list[EngineCoreOutputs]:
    """A step's outputs in chunks of `size` requests (the step's stats with the first)."""
    items = outputs.outputs
    if len(items) <= size:
        return [outputs]
    return [EngineCoreOutputs(items[start:start + size], outputs.stats if start == 0 else None)
            for start in range(0, len(items), size)]


def _load_tokenizer(source: str, revision: str | None):
    from llmserve.model.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(source, revision))
