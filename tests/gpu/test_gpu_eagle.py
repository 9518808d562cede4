"""EAGLE heads on a CUDA device, float32: the engine's drafts against the reference (tests/eagle_reference.py) and
greedy outputs equal plain decoding's, with the features read from the target's graphs (EAGLE-3's kept layer
inputs among the captured tensors). A difference is allowed only at a logit near-tie (as in test_gpu_engine.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.testing.eagle_maker import make_eagle_head
from llmserve.testing.maker import make_model

from eagle_reference import check_drafts, record_rows
from greedy_check import check_greedy_against_hf
from spec_cases import repeating_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ENGINE = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=400, max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model("llama", "demo", str(tmp_path_factory.mktemp("target")), seed=2)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_drafts_and_greedy_outputs_on_cuda(target, method, tmp_path):
    head = make_eagle_head(target, str(tmp_path / method), method, seed=1,
                           draft_vocab_size=1024 if method == "eagle3" else None)
    prompts = repeating_prompts(6, seed=3)
    want = [list(o.outputs[0].token_ids) for o in LLM(target, **ENGINE).generate(prompts, PARAMS)]
    llm = LLM(target, speculative=method, draft_model=head, num_speculative_tokens=3, speculative_dynamic=False,
              speculative_max_batch=16, enable_prefix_caching=False, **ENGINE)
    assert llm.engine.runner.verify_graphs is not None  # the features come out of the verification graphs
    calls = record_rows(llm)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS)]
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert calls
    num_ties = sum(check_drafts(method, head, hf, tokens, drafts, tie_gap=1e-3) for tokens, drafts in calls)
    if num_ties:
        warnings.warn(f"{num_ties} drafts differ from the reference's at a logit near-tie")
    for prompt, a, b in zip(prompts, got, want):
        if a != b:
            note = check_greedy_against_hf(hf, prompt, a, tie_gap=1e-4)  # raises beyond a near-tie
            if note:
                warnings.warn(f"speculative and plain differ: {note}")
    llm.engine.check_integrity()
