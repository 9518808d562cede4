"""What the speculative-decoding tests share, on CPU (tests/unit) and CUDA (tests/gpu): the random target
checkpoint, a draft derived from it, prompts that n-gram lookup finds matches in, and a recorder of proposals.
A test module imports the fixtures by name (pytest finds fixtures among a module's globals)."""

from __future__ import annotations

import random

import pytest

from llmserve.testing.draft_maker import derive_draft
from llmserve.testing.maker import make_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("target")), seed=2)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    """The target's first layer with 20% weight noise: accepts some drafts, rejects others."""
    return derive_draft(target, str(tmp_path_factory.mktemp("draft")), num_layers=1, noise=0.2, seed=1)


def repeating_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a span (n-gram lookup finds matches) mixed with plain random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        span = [rng.randrange(3, 500) for _ in range(rng.randint(3, 20))]
        prompts.append(span * 3 if i % 2 == 0 else span + [rng.randrange(3, 500) for _ in range(30)])
    return prompts


def record_proposals(llm) -> list[tuple[list[list[int]], list]]:
    """Every proposal the engine's proposer returns from now on: (drafts per row, q per row)."""
    proposer, calls = llm.engine.runner.speculator.proposer, []
    original = proposer.propose

    def propose(rows):
        drafts, probs = original(rows)
        calls.append((drafts, probs))
        return drafts, probs

    proposer.propose = propose
    return calls
