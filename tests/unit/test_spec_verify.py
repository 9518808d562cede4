"""Verification of drafts (spec.verify): the plain-greedy shortcut (argmax at each position, drafts kept
while they equal it) emits what the general path (per-position sampling rows) emits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.sample.sampler import Sampler
from llmserve.sampling_params import SamplingParams
from llmserve.spec.verify import verify


@dataclass
class _Row:
    is_plain_greedy: bool
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0, max_tokens=8))
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=lambda: [4])
    stop_token_ids_for_min_tokens: list[int] = field(default_factory=list)


def test_plain_greedy_shortcut_emits_what_sampling_emits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3 + 1 + 5, 50, generator=gen)  # rows with 2, 0 and 4 drafts: 3 + 1 + 5 positions
    target = logits.argmax(dim=-1).tolist()
    wrong_1, wrong_7 = (7 if target[1] != 7 else 8), (9 if target[7] != 9 else 8)
    drafts = [[target[0], wrong_1], [], [target[4], target[5], target[6], wrong_7]]
    sampler = Sampler(torch.Generator().manual_seed(1))
    fast = verify(sampler, logits, [_Row(True) for _ in drafts], drafts, [None] * 3, 50)
    slow = verify(sampler, logits, [_Row(False) for _ in drafts], drafts, [None] * 3, 50)
    assert fast.num_accepted == slow.num_accepted == [1, 0, 3]
    assert fast.token_ids == slow.token_ids == [[target[0], target[1]], [target[3]], [*target[4:7], target[7]]]
