"""Multi-LoRA through the engine: greedy tokens per adapter equal transformers + peft's, in batches that mix
adapters and the base model, through chunked prefill, prefix-cache hits and adapter swaps."""

from __future__ import annotations

import pytest
from hf_parity import random_prompt
from lora_helpers import make_adapter, peft_greedy

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.testing.maker import make_model

NUM_OUT = 8
VOCAB = 512
ADAPTERS = [dict(rank=4, alpha=8), dict(rank=8, alpha=16, targets=["q_proj", "v_proj", "o_proj"]),
            dict(rank=16, alpha=16, use_rslora=True), dict(rank=8, alpha=32, targets=["gate_proj", "up_proj", "down_proj"])]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base path, adapters as LoRARequests, prompts, {(adapter index or None, prompt index): peft's tokens})."""
    root = tmp_path_factory.mktemp("lora")
    base = make_model("llama", "tiny", str(root / "base"), seed=1)
    loras = [LoRARequest(f"adapter{i}", i + 1, make_adapter(base, str(root / f"a{i}"), seed=20 + i, **kwargs))
             for i, kwargs in enumerate(ADAPTERS)]
    prompts = [random_prompt(18 + 3 * i, seed=i, vocab_size=VOCAB) for i in range(5)]
    return base, loras, prompts


def _reference(setup, adapter: int | None, prompt: int) -> list[int]:
    base, loras, prompts = setup
    return peft_greedy(base, None if adapter is None else loras[adapter].lora_path, prompts[prompt], NUM_OUT)


def _generate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]):
    params = SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True)
    return llm.generate(prompts, params, lora_request=loras)


@pytest.fixture(scope="module")
def references(setup):
    """Prompt i runs with adapter i (prompt 4 with the base model)."""
    return [_reference(setup, i if i < 4 else None, i) for i in range(5)]


def test_a_batch_mixing_four_adapters_and_the_base_model_matches_peft(setup, references):
    base, loras, prompts = setup
    # 16-token steps: the prompts are chunked, and rows of different adapters share every step
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, block_size=4,
              max_num_batched_tokens=16)
    outs = _generate(llm, prompts, [*loras, None])
    assert [list(o.outputs[0].token_ids) for o in outs] == references
    again = _generate(llm, prompts, [*loras, None])  # each prompt's blocks cached under its own adapter
    assert all(o.num_cached_tokens >= 16 for o in again)
    assert [list(o.outputs[0].token_ids) for o in again] == references
    llm.engine.check_integrity()


def test_a_prefix_cached_with_one_adapter_never_serves_another(setup):
    base, loras, prompts = setup
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4)
    first = _generate(llm, [prompts[0]], [loras[0]])[0]
    other = _generate(llm, [prompts[0]], [loras[2]])[0]
    plain = _generate(llm, [prompts[0]], [None])[0]
    same = _generate(llm, [prompts[0]], [loras[0]])[0]
    assert (other.num_cached_tokens, plain.num_cached_tokens) == (0, 0)
    assert same.num_cached_tokens >= 16
    assert list(other.outputs[0].token_ids) == _reference(setup, 2, 0)
    assert list(plain.outputs[0].token_ids) == _reference(setup, None, 0)
    assert list(same.outputs[0].token_ids) == list(first.outputs[0].token_ids) == _reference(setup, 0, 0)


def test_adapters_swap_through_fewer_slots_than_adapters(setup, references):
    """Two slots and two adapters in host memory for four adapters: requests wait for a slot, adapters
    are evicted and read again, and every request still gets its own adapter's tokens."""
    base, loras, prompts = setup
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
              block_size=4, enable_prefix_caching=False)
    order = [3, 0, 4, 2, 1, 0, 3]  # prompt i with adapter i (4: base), some twice
    outs = _generate(llm, [prompts[i] for i in order], [loras[i] if i < 4 else None for i in order])
    assert [list(o.outputs[0].token_ids) for o in outs] == [references[i] for i in order]
    manager = llm.engine.runner.lora
    assert manager.num_loads >= 4 and len(manager.host) == 2
    llm.engine.check_integrity()


def test_merged_adapter_gives_the_same_tokens(setup, references):
    """peft's merge_and_unload (the adapter folded into the weights) agrees with the unmerged reference."""
    base, loras, prompts = setup
    assert peft_greedy(base, loras[1].lora_path, prompts[1], NUM_OUT, is_merged=True) == references[1]


def test_qwen2_adapter_matches_peft(tmp_path):
    base = make_model("qwen2", "tiny", str(tmp_path / "base"), seed=2)  # q/k/v carry a bias
    lora = LoRARequest("q", 1, make_adapter(base, str(tmp_path / "a"), seed=5, rank=8))
    prompt = random_prompt(21, seed=9, vocab_size=VOCAB)
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4)
    outs = _generate(llm, [prompt, prompt], [lora, None])
    assert list(outs[0].outputs[0].token_ids) == peft_greedy(base, lora.lora_path, prompt, NUM_OUT)
    assert list(outs[1].outputs[0].token_ids) == peft_greedy(base, None, prompt, NUM_OUT)


def test_a_lora_request_without_enable_lora_is_refused(setup):
    base, loras, prompts = setup
    llm = LLM(base, dtype="float32", block_size=4)
    with pytest.raises(ValueError, match="without --enable-lora"):
        _generate(llm, [prompts[0]], [loras[0]])


@pytest.mark.parametrize("engine_args", [dict(speculative="ngram", num_speculative_tokens=3),
                                         dict(async_scheduling=True, num_scheduler_steps=1)],
                         ids=["ngram-speculation", "async-scheduling"])
def test_adapters_with_speculation_and_async_scheduling(setup, engine_args):
    """Drafts verified with the adapter on (a verification step is a segmented one); steps overlapped."""
    base, loras, prompts = setup
    prompt = prompts[0] + prompts[0][:12]  # a repeat for the n-gram proposer to find
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, block_size=4, **engine_args)
    outs = _generate(llm, [prompt, prompt], [loras[2], None])
    assert list(outs[0].outputs[0].token_ids) == peft_greedy(base, loras[2].lora_path, prompt, NUM_OUT)
    assert list(outs[1].outputs[0].token_ids) == peft_greedy(base, None, prompt, NUM_OUT)
    llm.engine.check_integrity()


def test_preempted_requests_give_their_slot_back_and_resume_with_their_adapter(setup, references):
    """Too few KV blocks for all: requests are preempted (their slot freed) and resume with their adapter."""
    base, loras, prompts = setup
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4,
              num_kv_blocks=16, max_model_len=40, enable_prefix_caching=False)
    outs = _generate(llm, prompts, [*loras, None])
    assert llm.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == references
    llm.engine.check_integrity()
