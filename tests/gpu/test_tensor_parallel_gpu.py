"""Tensor parallelism over NCCL: 2 GPUs give the greedy tokens of 1 (float32, tiny random model).

Skipped with fewer than 2 GPUs. With tensor parallelism the decode steps run eagerly (no CUDA graphs:
the all-reduces are not captured yet), so the reference runs eagerly too.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason="tensor parallelism over NCCL needs 2 CUDA devices")]

ENGINE = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=128,
              enforce_eager=True)


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 120))] for _ in range(num)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_gpus_give_one_gpu_greedy_tokens(arch, tmp_path):
    path = make_model(arch, "tiny", str(tmp_path), seed=5)
    prompts, params = _prompts(8, seed=1), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(prompts, params)]
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        llm.engine.check_integrity()
