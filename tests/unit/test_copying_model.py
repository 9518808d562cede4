"""`make-model --copying`: weights that continue the spans their context repeats (testing/copying.py)."""

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.bench.spec import SpecCounter
from llmserve.testing.draft_maker import derive_draft
from llmserve.testing.maker import make_model

NUM_OUT = 48


def _repeating_prompts(vocab_size: int, num: int = 4, span_len: int = 16, length: int = 128) -> list[list[int]]:
    rng = random.Random(0)
    spans = [[rng.randrange(10, vocab_size) for _ in range(span_len)] for _ in range(num)]
    return [(span * (length // span_len + 1))[:length] for span in spans]


def _continuation(prompt: list[int], span_len: int = 16) -> list[int]:
    """What copying the repeated span gives after the prompt."""
    return [prompt[(len(prompt) + i) % span_len] for i in range(NUM_OUT)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def copying_model(tmp_path_factory):
    return make_model("llama", "demo", str(tmp_path_factory.mktemp("copying")), seed=3, is_copying=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_continues_repeated_spans_where_random_weights_do_not(copying_model, tmp_path, dtype):
    prompts = _repeating_prompts(2048)
    llm = LLM(copying_model, dtype=dtype, max_model_len=256, num_kv_blocks=128)
    assert _greedy(llm, prompts) == [_continuation(p) for p in prompts]
    plain = LLM(make_model("llama", "demo", str(tmp_path / "plain"), seed=3), dtype=dtype, max_model_len=256,
                num_kv_blocks=128)
    copied = sum(a == b for p, out in zip(prompts, _greedy(plain, prompts)) for a, b in zip(out, _continuation(p)))
    assert copied < NUM_OUT // 4  # the random weights the flag replaces copy next to nothing


def test_transformers_runs_the_same_circuit(copying_model):
    """The checkpoint is a plain Llama one: transformers' own model copies too (no quirk of our engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = _repeating_prompts(2048, num=1)[0]
    model = AutoModelForCausalLM.from_pretrained(copying_model, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert out[0, len(prompt):].tolist() == _continuation(prompt)[:16]


def test_ngram_speculation_accepts_the_copied_spans_and_equals_plain(copying_model):
    prompts = _repeating_prompts(2048)
    llm = LLM(copying_model, max_model_len=256, num_kv_blocks=256, speculative="ngram", num_speculative_tokens=4,
              speculative_max_batch=8)
    counts = SpecCounter(llm)
    assert _greedy(llm, prompts) == [_continuation(p) for p in prompts]
    assert counts.num_draft_tokens > 0 and counts.num_accepted / counts.num_draft_tokens > 0.9
    llm.engine.check_integrity()


def test_a_draft_of_its_first_two_layers_copies_too(copying_model, tmp_path):
    """The circuit lives in layers 0 and 1, so a layer-skipping draft of them proposes what the target copies."""
    draft = derive_draft(copying_model, str(tmp_path / "draft"), num_layers=2)
    prompts = _repeating_prompts(2048)
    llm = LLM(copying_model, max_model_len=256, num_kv_blocks=256, speculative="draft", draft_model=draft,
              num_speculative_tokens=4, speculative_max_batch=8)
    counts = SpecCounter(llm)
    assert _greedy(llm, prompts) == [_continuation(p) for p in prompts]
    assert counts.num_draft_tokens > 0 and counts.num_accepted / counts.num_draft_tokens > 0.9
    llm.engine.check_integrity()


@pytest.mark.parametrize("arch, is_peaked", [("qwen3", False), ("llama", True)])
def test_copying_is_refused_where_the_circuit_does_not_fit(tmp_path, arch, is_peaked):
    with pytest.raises(ValueError, match="copying weights are for llama, mistral"):
        make_model(arch, "tiny", str(tmp_path / "m"), is_copying=True, is_peaked=is_peaked)
