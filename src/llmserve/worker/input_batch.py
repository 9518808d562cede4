"""Per-request state the model runner keeps across steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve.sampling_params import SamplingParams
from llmserve.worker.persistent_batch import PersistentBatch


@dataclass
class CachedRequestState:
    """What the runner knows of a request between steps (also a sample.SamplingRow). What changes every
    step (its token history, computed count, count of ids still on the device) lives in its row of the
    runner's PersistentBatch (`batch`, row `row`): the properties below read it there."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    stop_token_ids_for_min_tokens: list[int]
    batch: PersistentBatch
    row: int = -1  # its row in `batch`
    draft_probs: torch.Tensor | None = None  # [k, V] q of the drafts proposed last step (draft model)
    num_draft_computed: int = 0  # tokens whose KV the draft model has written (draft model)
    has_penalties: bool = False  # its sampling reads its output ids
    is_dynamic: bool = False  # its sampling inputs change with its tokens (min_tokens' masks)
    is_plain_greedy: bool = False  # greedy with nothing else to apply: its sampling needs no per-row inputs

    def __post_init__(self) -> None:
        p = self.params
        self.has_penalties = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self.is_dynamic = bool(p.min_tokens)
        self.is_plain_greedy = (p.temperature == 0.0 and not self.is_dynamic and not self.has_penalties
                                and not p.logit_bias and p.logprobs is None)

    @property
    def token_ids(self) -> np.ndarray:
        """[L] int64 prompt + output ids on the host: a view of its batch row, to read before the batch
        changes again (not to keep)."""
        return self.batch.token_ids[self.row, :self.batch.num_tokens[self.row]]

    @property
    def output_token_ids(self) -> list[int]:
        """Output ids on the host (a new list each time)."""
        return self.batch.token_ids[self.row, len(self.prompt_token_ids):self.batch.num_tokens[self.row]].tolist()

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed, or scheduled in a launched step (drafts until rolled back)."""
        return int(self.batch.num_computed[self.row])

    @num_computed_tokens.setter
    def num_computed_tokens(self, num: int) -> None:
        self.batch.num_computed[self.row] = num

    @property
    def num_pending(self) -> int:
        """Ids sampled on the device whose values are not on the host yet."""
        return int(self.batch.num_pending[self.row])

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, the ones still on the device included."""
        row = self.row
        return int(self.batch.num_tokens[row] + self.batch.num_pending[row]) - len(self.prompt_token_ids)
