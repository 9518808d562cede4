"""Adapters on a quantized base (--quantization int8: W8A8; fp8: e4m3, CPU's reference path): the adapter's
product is added to the quantized projection's output, as transformers + peft do over the same quantized
layers (ours, swapped into the HF model under peft's LoRA layers); greedy tokens equal."""

from __future__ import annotations

import pytest
import torch
from hf_parity import hf_greedy, random_prompt
from lora_helpers import hf_base, make_adapter

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.model.quant import quantized_linear
from llmserve.testing.maker import make_model

NUM_OUT = 8


def peft_over_quantized_greedy(base: str, adapter_dir: str | None, prompt: list[int], method: str) -> list[int]:
    """transformers + peft with every base nn.Linear replaced by our quantized layer (lm_head only for int8,
    as quantize_model does); the adapters' A and B stay float32."""
    from peft import PeftModel

    from transformers import GenerationConfig

    model = hf_base(base)
    model.generation_config = GenerationConfig(do_sample=False, pad_token_id=0)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    linears = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and "lora_" not in name
               and (method == "int8" or not name.endswith("lm_head"))]
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, quantized_linear(linear.weight, linear.bias, method))
    return hf_greedy(model, prompt, NUM_OUT)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-int8")
    base = make_model("llama", "tiny", str(root / "base"), seed=2)
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(base, str(root / f"a{i}"), seed=50 + i, rank=4 + 4 * i))
             for i in range(2)]
    prompts = [random_prompt(12 + 4 * i, seed=60 + i, vocab_size=512) for i in range(3)]
    return base, loras, prompts


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_adapters_on_a_quantized_base_match_peft_over_the_same_layers(setup, method):
    base, loras, prompts = setup
    llm = LLM(base, dtype="float32", quantization=method, enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[*loras, None])
    expected = [peft_over_quantized_greedy(base, lora.lora_path if lora else None, prompt, method)
                for lora, prompt in zip([*loras, None], prompts)]
    assert expected[0] != peft_over_quantized_greedy(base, None, prompts[0], method)  # the adapter counts
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    llm.engine.check_integrity()
