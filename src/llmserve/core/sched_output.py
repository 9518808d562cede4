"""What the scheduler tells the model runner each step: new requests in full, the rest as diffs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.lora_request import LoRARequest
from llmserve.sampling_params import SamplingParams
from llmserve.structured.bitmask import StepGrammar

if TYPE_CHECKING:
    from llmserve.core.request import Request


@dataclass
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids_for_min_tokens: list[int]
    lora: LoRARequest | None = None  # its adapter (None: the base model)


def new_request_data(request: Request, block_ids: list[int]) -> NewRequestData:
    """What the runner gets of a request it has not seen (its blocks so far counted as the runner's)."""
    request.num_runner_blocks = len(block_ids)
    return NewRequestData(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                          output_token_ids=request.output_token_ids, sampling_params=request.sampling_params,
                          block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
                          stop_token_ids_for_min_tokens=sorted(request.any_stop_token_ids), lora=request.lora)


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    num_old_blocks: int  # blocks the runner keeps before appending new_block_ids (trimmed ones dropped)


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # in row order
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # finished or preempted since last step
    # Speculative decoding: the draft tokens scheduled after each row's real tokens (rows with drafts
    # only), and whether the runner should propose drafts for the next step.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    use_speculation: bool = False
    # Structured outputs: the grammars of the rows that sample this step (the runner fills their bitmask
    # once the forward is launched, so on a GPU the fill overlaps it).
    grammar: StepGrammar | None = None
    # Multi-step decoding (core/decode_window.py): every row is a plain decode row that runs
    # num_scheduled_tokens[row] forwards of one token each, back to back; this many forwards in all.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per scheduled request (row order): the sampled token ids (empty for a partial prefill; with
    speculation the accepted drafts and one more token)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list] | None = None  # per row: a list of llmserve.messages.Logprobs, or None
    spec_token_ids: list[list[int]] | None = None  # per row: drafts proposed for the next step
    prompt_logprobs: list | None = None  # per row: llmserve.messages.PromptLogprobs of its chunk, or None
    num_accepted: list[int] | None = None  # per row: drafts the target accepted (None: no drafts this step)
    # A pooling step (--runner pooling): per row its pooled vector (float32 bytes) where its prompt ended,
    # else None; nothing is sampled
    pooled: list[bytes | None] | None = None
