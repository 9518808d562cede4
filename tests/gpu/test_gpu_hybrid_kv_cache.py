"""KV cache groups on a CUDA device (core/kv_cache_groups.py): the tiny Gemma 3 (five sliding layers to one
full, window 8, six groups) through the Triton kernel with CUDA graphs that hold a block table per group gives
the eager engine's tokens, and those of one group of every layer (--disable-hybrid-kv-cache-manager)."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ENGINE = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=1600, max_num_batched_tokens=128)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS)
    llm.engine.check_integrity()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_groups_with_cuda_graphs_equal_eager_and_one_group(tmp_path):
    path = make_model("gemma3", "tiny-gemma3", str(tmp_path / "tiny-gemma3"), seed=5)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 120))] for _ in range(40)]  # batches of 1..40
    graphed = LLM(path, **ENGINE)
    assert graphed.engine.scheduler.kv.num_groups == 6 and graphed.engine.runner.graphs is not None
    tokens = _tokens(graphed, prompts)
    assert tokens == _tokens(LLM(path, enforce_eager=True, **ENGINE), prompts)
    assert tokens == _tokens(LLM(path, disable_hybrid_kv_cache_manager=True, **ENGINE), prompts)
