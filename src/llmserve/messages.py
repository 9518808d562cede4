"""Typed records that cross the engine-core boundary (in-process or over ZMQ, msgpack-encoded).

The front (LLM / AsyncLLM) sends EngineCoreRequest and abort lists; the core answers with
EngineCoreOutputs once per step. Never pickle: these are msgspec Structs.
"""

from __future__ import annotations

import enum

import msgspec

from llmserve.lora_request import LoRARequest
from llmserve.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the context length
    ABORT = 2  # client went away, shutdown, or an error

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    # Siblings of an n > 1 request share this id; all but the first wait for the first's prefill
    # so that they reuse its prompt blocks through the prefix cache.
    parent_id: str | None = None
    # The front reads only the finished sequence (offline, no stop strings, no logprobs): the core reports
    # the request once, when it ends, with all its output ids, instead of one output a step.
    is_final_only: bool = False
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs of one sampled position: the sampled token first, then the top-k (rank order)."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # rank of the sampled token among all (1 = most likely)


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens start, start + 1, ... (each given the tokens before it; start >= 1)."""

    start: int
    logprobs: list[Logprobs]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # the prompt tokens this step's chunk scored
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Engine-side timestamps (time.time()) for metrics.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # --runner pooling: the prompt's pooled vector (float32, little-endian), on the output that ends it
    pooled: bytes | None = None


class SpecDecodeStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Speculative decoding in one step: rows verified, drafts checked and accepted, per position."""

    num_drafts: int = 0  # rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []  # [k]: rows whose draft at position j was accepted


class GrammarStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Structured outputs since the last step: grammar cache queries and hits, and each new compile's time."""

    num_queries: int = 0
    num_hits: int = 0
    compile_seconds: list[float] = []


class KVTierStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The KV connector's counts over some steps (core/kv_connector.py): prompt tokens served from each tier
    below the device instead of computed, blocks copied out, corrupt disk blocks found (and recomputed),
    and blocks a prefill server sent or a decode server received (disaggregation)."""

    num_host_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    num_offloaded_blocks: int = 0  # let go of by the device, copied to host memory or disk
    num_corrupt_blocks: int = 0
    num_sent_blocks: int = 0
    num_received_blocks: int = 0


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0  # usable blocks
    num_free_kv_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0  # this step
    num_scheduled_tokens: int = 0  # this step
    num_prompt_tokens: int = 0  # prompt tokens computed this step
    num_generation_tokens: int = 0  # tokens sampled this step
    step_time: float = 0.0  # seconds
    timestamp: float = 0.0
    spec: SpecDecodeStats | None = None  # None when no drafts were verified this step
    grammar: GrammarStats | None = None  # None when no grammar was asked for or compiled
    expert_balance: float | None = None  # MoE: tokens per expert, max / mean, over this step's layers; else None
    kv_tiers: KVTierStats | None = None  # None without a KV connector or when it did nothing
    resident_loras: list[str] | None = None  # LoRA: the adapters in the runner's slots, by name; None: LoRA off


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
