"""Multi-LoRA with --tensor-parallel-size 2 on CPU (2 gloo ranks): each rank holds its share of every adapter
(column-parallel projections: A whole, B's rows of the rank's outputs; row-parallel: A's columns of its
inputs, B whole), and greedy tokens in a batch mixing two adapters and the base model equal one rank's and
transformers + peft's."""

from __future__ import annotations

import torch
from hf_parity import random_prompt
from lora_helpers import make_adapter, peft_greedy

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.model.lora_adapter import LoRAWeights
from llmserve.model.lora_layers import shard_adapter
from llmserve.model.parallel import shard_layout
from llmserve.model.shapes import SHAPES
from llmserve.testing.maker import make_model

NUM_OUT = 8
ENGINE = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4,
              max_num_batched_tokens=16, num_kv_blocks=100, max_model_len=64)


def test_two_ranks_with_two_adapters_and_the_base_model_match_one_rank_and_peft(tmp_path):
    base = make_model("llama", "tiny", str(tmp_path / "base"), seed=1)
    loras = [LoRARequest("all", 1, make_adapter(base, str(tmp_path / "a0"), seed=30, rank=8, alpha=16)),
             LoRARequest("some", 2, make_adapter(base, str(tmp_path / "a1"), seed=31, rank=16, alpha=16,
                                                 targets=["k_proj", "o_proj", "up_proj", "down_proj"],
                                                 use_rslora=True))]
    prompts = [random_prompt(17 + 4 * i, seed=40 + i, vocab_size=512) for i in range(3)]
    requests = [*loras, None]  # chunked prompts of both adapters and the base model share the steps
    params = SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True)
    expected = [peft_greedy(base, None if lora is None else lora.lora_path, prompt, NUM_OUT)
                for prompt, lora in zip(prompts, requests)]
    one_rank = LLM(base, **ENGINE).generate(prompts, params, lora_request=requests)
    assert [list(o.outputs[0].token_ids) for o in one_rank] == expected
    with LLM(base, tensor_parallel_size=2, **ENGINE) as llm:
        outs = llm.generate(prompts, params, lora_request=requests)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        llm.engine.check_integrity()


def test_rank_shares_of_an_adapter_sum_to_the_whole_products():
    """Per module, the ranks' shares give the whole x @ A^T @ B^T: column-parallel outputs joined in rank
    order, row-parallel partial products summed (what the all-reduce does)."""
    config = _tiny_config()
    gen = torch.Generator().manual_seed(3)
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = hidden, hidden * config.num_key_value_heads // config.num_attention_heads
    sizes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "o_proj": (q, hidden), "up_proj": (hidden, inter),
             "down_proj": (inter, hidden)}
    whole = LoRAWeights(4, {(1, m): (torch.randn(4, i, generator=gen), torch.randn(o, 4, generator=gen))
                            for m, (i, o) in sizes.items()})
    shares = [shard_adapter(whole, shard_layout(config, 2, rank)) for rank in range(2)]
    for (layer, module), (a, b) in whole.modules.items():
        x = torch.randn(3, a.shape[1], generator=gen)
        full = x @ a.T @ b.T  # [3, out]
        parts = [share.modules[(layer, module)] for share in shares]
        if module in ("o_proj", "down_proj"):
            half = a.shape[1] // 2
            got = sum(x[:, r * half:(r + 1) * half] @ pa.T @ pb.T for r, (pa, pb) in enumerate(parts))
        else:
            got = torch.cat([x @ pa.T @ pb.T for pa, pb in parts], dim=1)
        torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)


def _tiny_config():
    from transformers import LlamaConfig

    shape = SHAPES["tiny"]
    return LlamaConfig(hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                       intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size)
