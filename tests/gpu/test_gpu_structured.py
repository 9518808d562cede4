"""Structured outputs on a CUDA device: the bitmask through the runner's pinned buffers and xgrammar's Triton
kernel masks as the CPU does, step after step; constrained outputs hold in the overlapped engine with CUDA
graphs beside unconstrained requests (which rows the mask touches: the first test and the unit tests)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.loader import load_tokenizer
from llmserve.sampling_params import StructuredOutputsParams as Constraint
from llmserve.structured.bitmask import BitmaskFiller, StepGrammar, unpack_bitmask
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import RequestGrammar
from llmserve.testing.maker import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
NUMBERS = r"\((\d{1,3})( \+ \d{1,3}){0,3}\)"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("gpu-tiny")), seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_masks_as_the_host_does(checkpoint, dtype):
    tokenizer = load_tokenizer(checkpoint)
    vocab_size = 512
    compiled = GrammarCompiler(lambda: tokenizer, vocab_size, [tokenizer.eos_token_id]).submit(Constraint(regex=EMAIL))
    filler = BitmaskFiller(vocab_size, torch.device("cuda"))
    rng = random.Random(0)
    for step in range(5):  # both buffers, twice
        step_grammar, ids = StepGrammar(), []
        for i in range(rng.randint(3, 40)):
            ids.append(f"r{i}")
            if i % 3:
                grammar = RequestGrammar(compiled)
                grammar.compiled.result()
                grammar.start()
                for token_id in tokenizer.encode("abcd@xy"[:rng.randint(0, 7)], add_special_tokens=False):
                    assert grammar.accept(token_id)
                step_grammar.add(f"r{i}", grammar)
        bitmask, indices = filler.fill(step_grammar, ids)
        assert bitmask.is_pinned()
        logits = torch.randn(len(ids), vocab_size, device="cuda", dtype=dtype)
        masked = logits.clone()
        filler.apply(masked, bitmask, indices)
        allowed = unpack_bitmask(bitmask[indices], vocab_size).cuda()
        assert torch.equal(masked[indices], logits[indices].masked_fill(~allowed, float("-inf"))), step
        free = sorted(set(range(len(ids))) - set(indices))
        assert torch.equal(masked[free], logits[free])


def test_constrained_outputs_hold_beside_free_ones(checkpoint):
    llm = LLM(checkpoint, device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=512)
    assert llm.engine.runner.graphs is not None
    prompts = [[(5 * i + 11 * j) % 300 + 3 for j in range(4 + (7 * i) % 20)] for i in range(12)]
    free = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in range(6)]
    constraints = [Constraint(regex=EMAIL), Constraint(regex=NUMBERS), Constraint(choice=["yes", "no", "maybe"])]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=constraints[i % 3])
                   for i in range(6)]
    params = [p for pair in zip(free, constrained) for p in pair]
    outputs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs[::2])
    for i, out in enumerate(outputs[1::2]):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        if i % 3 == 2:
            assert text in ("yes", "no", "maybe")
        else:
            assert re.fullmatch(EMAIL if i % 3 == 0 else NUMBERS, text), text
    llm.engine.check_integrity()
