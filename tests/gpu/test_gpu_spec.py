"""Speculative decoding on a CUDA device, float32: greedy outputs equal plain decoding's (the draft model's
forwards, verification and rejection all run on the device), and a target that drafts for itself accepts
every draft. Same tolerance policy as test_gpu_engine.py: a difference is allowed only at a logit near-tie."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.bench.spec import SpecCounter

from greedy_check import check_greedy_against_hf
from spec_cases import draft, record_proposals, repeating_prompts, target  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ENGINE = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=400, max_num_batched_tokens=128)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS)]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_greedy_equals_plain_on_cuda(target, draft, kind):
    prompts = repeating_prompts(16, seed=3)
    want = _tokens(LLM(target, **ENGINE), prompts)
    extra = {"draft_model": draft} if kind == "draft" else {}
    if kind == "draft":
        extra["speculative_queue_drafts"] = True
    llm = LLM(target, speculative=kind, num_speculative_tokens=3, speculative_dynamic=False,
              speculative_max_batch=16, **extra, **ENGINE)  # every row of every step speculates
    counts = SpecCounter(llm)
    got = _tokens(llm, prompts)
    assert counts.num_accepted > 0
    if kind == "draft":  # the draft's later forwards replayed its captured graphs (spec.draft_chain), and
        proposer = llm.engine.runner.speculator.proposer  # proposals were queued behind their verification
        assert proposer.num_chained > 0 and proposer.num_early > 0
    hf = None
    for prompt, a, b in zip(prompts, got, want):
        if a != b:
            if hf is None:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to("cuda").eval()
            note = check_greedy_against_hf(hf, prompt, a, tie_gap=1e-4)  # raises beyond a near-tie
            if note:
                warnings.warn(f"speculative and plain differ: {note}")
    llm.engine.check_integrity()


def test_target_as_its_own_draft_accepts_every_draft_on_cuda(target):
    llm = LLM(target, speculative="draft", draft_model=target, num_speculative_tokens=3, speculative_dynamic=False,
              speculative_queue_drafts=True, **ENGINE)
    counts = SpecCounter(llm)
    _tokens(llm, repeating_prompts(4, seed=5))
    assert counts.num_draft_tokens > 0 and counts.num_accepted == counts.num_draft_tokens
    proposer = llm.engine.runner.speculator.proposer
    assert proposer.num_chained > 0 and proposer.num_early > 0  # through the draft's graphs, still exact
    assert llm.engine.runner.verify_graphs.graphs  # verification steps replay captured graphs too
    llm.engine.check_integrity()


def test_ngram_on_a_copying_target_in_bf16_accepts_and_equals_plain(tmp_path):
    """bench spec's n-gram case on the device: a target that copies (make-model --copying) in bfloat16, the
    benchmark's precision; its clear argmaxes keep greedy speculation equal to plain decoding."""
    from llmserve.testing.maker import make_model

    model = make_model("llama", "demo", str(tmp_path / "copying"), seed=3, dtype="bfloat16", is_copying=True)
    prompts = [(span * 9)[:128] for span in ([(37 * i + 11 * j) % 2000 + 10 for j in range(16)] for i in range(8))]
    engine = {**ENGINE, "dtype": "bfloat16"}
    want = _tokens(LLM(model, **engine), prompts)
    assert want == [[p[(128 + i) % 16] for i in range(PARAMS.max_tokens)] for p in prompts]  # it copies
    llm = LLM(model, speculative="ngram", num_speculative_tokens=4, speculative_dynamic=False, **engine)
    counts = SpecCounter(llm)
    assert _tokens(llm, prompts) == want
    assert counts.num_accepted / counts.num_draft_tokens > 0.9
    llm.engine.check_integrity()


@pytest.mark.parametrize("head", ["prefix", "map"])
def test_a_reduced_draft_head_on_cuda_drafts_its_ids_and_keeps_greedy_outputs(target, tmp_path, head):
    """The target as its own draft with half its head (--draft-vocab-size: the first 256 of 512 ids;
    --draft-token-map: the upper half, reversed), its later forwards through the draft's graphs: drafts
    stay among the kept ids, some are rejected (the whole head accepts every one, above), and greedy
    outputs equal plain decoding's."""
    if head == "map":
        token_map = tmp_path / "map.json"
        token_map.write_text(json.dumps(list(range(511, 255, -1))))
        extra, kept = {"draft_token_map": str(token_map)}, range(256, 512)
    else:
        extra, kept = {"draft_vocab_size": 256}, range(256)
    prompts = repeating_prompts(8, seed=5)
    want = _tokens(LLM(target, **ENGINE), prompts)
    llm = LLM(target, speculative="draft", draft_model=target, num_speculative_tokens=3, speculative_dynamic=False,
              speculative_queue_drafts=True, **extra, **ENGINE)
    counts = SpecCounter(llm)
    proposer, calls = llm.engine.runner.speculator.proposer, record_proposals(llm)
    assert _tokens(llm, prompts) == want  # the target as its draft: the same sums, no near-tie to allow
    drafted = [t for drafts, _ in calls for row in drafts for t in row]
    assert drafted and all(t in kept for t in drafted)
    assert 0 < counts.num_accepted < counts.num_draft_tokens
    assert proposer.num_chained > 0
    llm.engine.check_integrity()
