"""prompt_logprobs=k: each prompt token's logprob given the tokens before it (transformers' forward
as the reference), its rank and top k; through chunked prefill, a warm prefix cache and overlap."""

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    make_model("llama", "tiny", path, seed=4)
    return path


def _reference(path, prompt: list[int]) -> torch.Tensor:
    """[L - 1, V] log-probabilities of the next token after each prompt position but the last."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


@pytest.mark.parametrize("is_async", [False, True])
def test_prompt_logprobs_match_transformers_through_chunks_and_cache(tiny, is_async):
    prompt = [(5 * j + 11) % 450 + 3 for j in range(70)]
    reference = _reference(tiny, prompt)
    llm = LLM(tiny, dtype="float32", max_num_batched_tokens=32, async_scheduling=is_async, num_kv_blocks=1024)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    for _ in range(2):  # the second run would hit the prefix cache: the prompt is computed anyway
        out = llm.generate([prompt], params)[0]
        scored = out.prompt_logprobs
        assert len(scored) == len(prompt) and scored[0] is None
        for pos in range(1, len(prompt)):
            lp, ref = scored[pos], reference[pos - 1]
            assert lp.token_id == prompt[pos]
            assert lp.logprob == pytest.approx(ref[prompt[pos]].item(), abs=1e-4)
            assert lp.rank == int((ref > ref[prompt[pos]]).sum()) + 1
            assert [t for t, _ in lp.top] == ref.topk(2).indices.tolist()
    assert out.num_cached_tokens == 0
    llm.engine.check_integrity()


def test_requests_without_prompt_logprobs_get_none(tiny):
    out = LLM(tiny, dtype="float32", num_kv_blocks=1024).generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0]
    assert out.prompt_logprobs is None


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
