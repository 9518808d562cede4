"""LoRA adapters on a CUDA device: the Triton kernels compiled, decode steps replayed from the CUDA graphs with
the adapters' products inside them, and `--lora-dtype bfloat16` slots under a float32 model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.testing.maker import make_model

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # the unit tests' peft helpers
from hf_parity import random_prompt  # noqa: E402
from lora_helpers import make_adapter, peft_greedy  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_OUT = 8
ENGINE = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
              num_kv_blocks=128)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-lora")
    base = make_model("llama", "tiny", str(root / "base"), seed=1)
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(base, str(root / f"a{i}"), seed=70 + i, rank=8))
             for i in range(2)]
    requests = [loras[0], None, loras[1], loras[0], None]
    prompts = [random_prompt(7 + 5 * i, seed=80 + i, vocab_size=512) for i in range(len(requests))]
    return base, requests, prompts


def _generate(llm: LLM, prompts, requests) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, lora_request=requests)]


def test_decode_graphs_with_adapters_give_peft_tokens_and_equal_eager(setup):
    base, requests, prompts = setup
    expected = [peft_greedy(base, None if lora is None else lora.lora_path, prompt, NUM_OUT)
                for prompt, lora in zip(prompts, requests)]
    with LLM(base, enforce_eager=True, **ENGINE) as eager:
        assert eager.engine.runner.graphs is None
        assert _generate(eager, prompts, requests) == expected
    with LLM(base, **ENGINE) as llm:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.lora is not None
        replays = []
        run = graphs.run
        graphs.run = lambda inputs: replays.append(inputs.input_ids.shape[0]) or run(inputs)
        assert _generate(llm, prompts, requests) == expected
        assert replays, "no decode step replayed a graph"
        llm.engine.check_integrity()


def test_bfloat16_slots_under_a_float32_model(setup):
    base, requests, prompts = setup
    one_adapter = [requests[0], None]
    with LLM(base, lora_dtype="bfloat16", **ENGINE) as llm:
        tokens = _generate(llm, prompts[:2], one_adapter)
    with LLM(base, **ENGINE) as full:
        assert tokens[1] == _generate(full, prompts[1:2], [None])[0]  # the base model's row is untouched
