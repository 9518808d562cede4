"""Prefix caching changes nothing in the outputs (float32 tiny model), and it does hit."""

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("pc")), seed=7)


def _llm(path, caching: bool) -> LLM:
    return LLM(path, dtype="float32", max_model_len=512, num_kv_blocks=80, max_num_batched_tokens=96,
               enable_prefix_caching=caching)


def _greedy(llm, prompts, max_tokens=10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_shared_prefix_batch_equal_with_and_without_caching(path):
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(70)] for _ in range(2)]
    prompts = [prefixes[i % 2] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))] for i in range(8)]
    cached, plain = _llm(path, True), _llm(path, False)
    first = _greedy(cached, prompts[:2])  # warm the cache with both prefixes
    assert first == _greedy(plain, prompts[:2])
    hits_before = cached.engine.scheduler.kv.pool.cached
    assert hits_before, "full blocks should be cached"
    assert _greedy(cached, prompts) == _greedy(plain, prompts)
    cached.engine.check_integrity()
    plain.engine.check_integrity()


def test_three_turn_conversation_hits_its_own_answers(path):
    cached, plain = _llm(path, True), _llm(path, False)
    history = [5, 6, 7, 8] * 10
    for turn in range(3):
        out_c = cached.generate([history], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        out_p = plain.generate([history], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        assert out_c.outputs[0].token_ids == out_p.outputs[0].token_ids
        if turn > 0:  # the previous prompt + answer is cached, in full blocks
            assert out_c.num_cached_tokens >= (len(history) - 20 - 12) // 16 * 16 > 0
        assert out_p.num_cached_tokens == 0
        history = history + out_c.outputs[0].token_ids + [9, 10, 11, 12] * 3
    cached.engine.check_integrity()
    assert cached.engine.num_free_blocks() == cached.engine.scheduler.kv.pool.num_usable_blocks


def test_n_greater_than_one_shares_prompt_blocks(path):
    llm = _llm(path, True)
    out = llm.generate([[3] * 50], SamplingParams(n=3, temperature=0.9, seed=1, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    assert out.num_cached_tokens == 48  # the siblings hit the first one's 3 full prompt blocks
    llm.engine.check_integrity()
