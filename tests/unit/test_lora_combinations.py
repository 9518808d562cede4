"""Adapters beside the engine's other features: a draft model's speculation (the draft runs without the
adapter, the target verifies with it) and structured outputs (the grammar's mask over the adapter's
logits); tokens equal transformers + peft's."""

from __future__ import annotations

import pytest
import torch
from hf_parity import random_prompt
from lora_helpers import hf_base, make_adapter, peft_greedy

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.testing.draft_maker import derive_draft
from llmserve.testing.maker import make_model

NUM_OUT = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-combos")
    base = make_model("llama", "tiny", str(root / "base"), seed=3)
    lora = LoRARequest("a", 1, make_adapter(base, str(root / "a"), seed=70, rank=8))
    prompts = [random_prompt(16, seed=80 + i, vocab_size=512) for i in range(2)]
    return base, lora, prompts, root


def test_a_draft_model_speculates_without_the_adapter_and_the_target_verifies_with_it(setup):
    base, lora, prompts, root = setup
    draft = derive_draft(base, str(root / "draft"), num_layers=1)  # the target's first layer, no adapter
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4, speculative="draft",
              draft_model=draft, num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[lora, None])
    assert list(outs[0].outputs[0].token_ids) == peft_greedy(base, lora.lora_path, prompts[0], NUM_OUT)
    assert list(outs[1].outputs[0].token_ids) == peft_greedy(base, None, prompts[1], NUM_OUT)
    llm.engine.check_integrity()


def _peft_next_logits(base: str, adapter_dir: str | None, prompt: list[int]) -> torch.Tensor:
    from peft import PeftModel

    model = hf_base(base)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]  # [vocab]


def test_a_choice_constraint_picks_the_adapters_best_choice(setup):
    """Each choice is one token: greedy under the constraint is the choice whose token peft's adapter
    scores highest."""
    base, lora, prompts, _ = setup
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4)
    tokenizer = llm.get_tokenizer()
    choices = [c for c in "abcdefghijklmnop" if len(tokenizer.encode(c, add_special_tokens=False)) == 1]
    assert len(choices) >= 8
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=choices))
    outs = llm.generate([prompts[0], prompts[0]], params, lora_request=[lora, None])
    picks = []
    for out, adapter in zip(outs, [lora.lora_path, None]):
        logits = _peft_next_logits(base, adapter, prompts[0])
        ids = [tokenizer.encode(c, add_special_tokens=False)[0] for c in choices]
        picks.append(choices[int(torch.argmax(logits[ids]))])
        assert out.outputs[0].text == picks[-1]
    assert picks[0] != picks[1]  # the adapter moved the pick: its logits were the ones masked
    llm.engine.check_integrity()
