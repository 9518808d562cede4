"""The runner's side of sampling: batched sampling inputs reused while the batch is unchanged, and the
sampled logprobs turned into per-row host records."""

from __future__ import annotations

from operator import attrgetter

import torch

from llmserve.messages import Logprobs
from llmserve.sample.metadata import SamplingMetadata, build_sampling_metadata
from llmserve.worker.input_batch import CachedRequestState
from llmserve.worker.penalty_tokens import PenaltyTokens
from llmserve.sample.seeds import position_seed


_REQ_ID, _IS_PLAIN_GREEDY = attrgetter("req_id"), attrgetter("is_plain_greedy")


class SamplingInputs:
    """Builds a step's SamplingMetadata, reusing the last one while the same rows sample in the same
    order and none has inputs that change with its tokens (min_tokens' masks): the common decode step
    then costs no host-to-device copy. Penalties read their tokens on the device (`penalty_tokens`, whose
    metadata is reused too while the rows stay). Rows that are all plain greedy (nothing but an argmax)
    share one metadata whatever the rows, so a batch that loses or gains such rows builds nothing either.
    Seeded rows' generators are set for their position."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.penalty_tokens = PenaltyTokens(vocab_size, device)
        self._key: tuple = ()
        self._meta: SamplingMetadata | None = None
        self._seeded: list[CachedRequestState] = []  # rows of the last metadata with a generator
        self._has_penalties = False  # a row of the last metadata has penalties (refreshed each step)
        self._generation = 0  # bumped when states are created: a new state may reuse a request id
        self._plain_greedy = SamplingMetadata(vocab_size, all_greedy=True, all_random=False)

    def invalidate(self) -> None:
        self._generation += 1

    def metadata(self, rows: list[CachedRequestState], is_all_plain_greedy: bool = False) -> SamplingMetadata:
        """`is_all_plain_greedy`: the caller knows every row is plain greedy (it counts its states)."""
        if is_all_plain_greedy:
            self._key, self._meta, self._seeded = (), self._plain_greedy, []
            return self._meta
        key = (self._generation, *map(_REQ_ID, rows))
        if key != self._key and all(map(_IS_PLAIN_GREEDY, rows)):
            self._key, self._meta, self._seeded = key, self._plain_greedy, []
        elif key != self._key or self._meta is None:
            self._meta = build_sampling_metadata(rows, self.vocab_size, self.device, with_penalties=False)
            self._seeded = [row for row in rows if row.generator is not None]
            self._has_penalties = any(row.has_penalties for row in rows)
            is_static = not any(row.is_dynamic for row in rows)
            self._key = key if is_static else ()
        if self._meta is not self._plain_greedy and self._has_penalties:
            self._meta.penalties = self.penalty_tokens.metadata(rows)
        for row in self._seeded:
            row.generator.manual_seed(position_seed(row.params.seed, row.num_output_tokens))
        return self._meta


def host_logprobs(host: dict[str, torch.Tensor], num_logprobs: list[int | None]) -> list | None:
    """Per sampling row [Logprobs] (the sampled token, then as many top tokens as it asked), or None."""
    if "lp_ids" not in host:
        return None
    ids, values, ranks = host["lp_ids"].tolist(), host["lp_values"].tolist(), host["lp_ranks"].tolist()
    return [None if n is None else [Logprobs(ids[j][:n + 1], values[j][:n + 1], ranks[j])]
            for j, n in enumerate(num_logprobs)]
