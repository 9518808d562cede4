"""The scheduler's view of one request (one sequence; n > 1 is fanned out by the front)."""

from __future__ import annotations

import enum

from llmserve.core.block_pool import BlockHash
from llmserve.lora_request import LoRARequest
from llmserve.messages import EngineCoreRequest, FinishReason
from llmserve.sampling_params import SamplingParams
from llmserve.structured.matcher import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_KV = 3  # its prefix is being copied in from a KV connector (core/kv_loading.py)
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    def finish_reason(self) -> FinishReason | None:
        return {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
                RequestStatus.FINISHED_ABORTED: FinishReason.ABORT}.get(self)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: list[int], arrival_time: float, max_tokens: int,
                 priority: int = 0, parent_id: str | None = None, cache_salt: int = 0,
                 is_final_only: bool = False, lora: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.any_stop_token_ids = self.eos_token_ids | self.stop_token_ids  # check_stop looks further on these
        self.arrival_time = arrival_time
        self.max_tokens = max_tokens  # resolved against the context length by the front
        self.max_num_tokens = len(prompt_token_ids) + max_tokens  # where the length stop is (the scheduler
        # caps it at the context length)
        self.priority = priority
        self.parent_id = parent_id
        self.lora = lora  # its adapter (None: the base model)
        self.num_lora_passes = 0  # requests of running adapters admitted past it while it waited for a slot
        # the hash chain starts from the adapter: a prefix computed with one adapter never serves another
        self.cache_salt = cache_salt if lora is None else hash((cache_salt, "lora", lora.lora_int_id))
        self.is_final_only = is_final_only  # one output, when it ends, with all its ids (EngineCoreRequest)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.has_loaded_kv = False  # a KV connector's load ran for it (once: then its prefix hits the device)
        self.block_hashes: list[BlockHash] = []
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step
        # Sampling steps scheduled whose token ids are not back yet (async scheduling: the step in
        # flight; 0 between steps without it). Each stands for one token position.
        self.num_placeholders = 0
        self.num_runner_blocks = 0  # blocks the runner holds for it: the scheduler sends only changes (-1: a
        # rollback of rejected drafts the runner has yet to hear of)
        # Structured outputs: the grammar the output follows (set by the engine when the params ask for one).
        self.grammar: RequestGrammar | None = None
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> Request:
        params = req.sampling_params
        room = max_model_len - len(req.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return cls(req.request_id, req.prompt_token_ids, params, req.eos_token_ids, req.arrival_time,
                   max_tokens, req.priority, req.parent_id, is_final_only=req.is_final_only, lora=req.lora)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extend the chained hashes to cover every full block of the tokens so far."""
        num_full = len(self.all_token_ids) // block_size
        while len(self.block_hashes) < num_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1].value if self.block_hashes else self.cache_salt
            tokens = tuple(self.all_token_ids[i * block_size:(i + 1) * block_size])
            self.block_hashes.append(BlockHash(hash((parent, tokens)), tokens))
        return self.block_hashes

    def __lt__(self, other: Request) -> bool:  # heap order for the priority policy
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)
