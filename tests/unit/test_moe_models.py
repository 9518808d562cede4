"""Qwen3-MoE and Mixtral checkpoints written by transformers itself: greedy tokens from the engine equal
transformers' `generate`, through a batch of mixed lengths, chunked prefill and a prefix-cache hit; what MoE
models cannot do yet is refused at load (quantized experts: test_quant_moe.py)."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.testing import toy_tokenizer
from llmserve.model.loader import load_hf_config, load_model
from llmserve.testing.maker import make_model
from llmserve.model.parallel import check_tensor_parallel

VOCAB = 512
NUM_OUT = 6
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, max_position_embeddings=256,
              initializer_range=0.1, rms_norm_eps=1e-5, eos_token_id=2, pad_token_id=0, bos_token_id=None)
ARCHS = {
    # layer 0 dense (mlp_only_layers), norm_topk_prob off: the un-renormalised weights
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, sliding_window=None)),
}


def write_checkpoint(arch: str, out_dir: str, seed: int = 0, **fields) -> str:
    """transformers' random-weight model of `arch`, saved as save_pretrained writes it, with the toy tokenizer."""
    import transformers

    config_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**_SHAPE, **extra, **fields},
                                                architectures=[model_name])
    torch.manual_seed(seed)
    getattr(transformers, model_name)(config).save_pretrained(out_dir)
    toy_tokenizer.save_tokenizer(out_dir, VOCAB, 256)
    return out_dir


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)), seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the engine's side ignores eos too
    return path, hf


def hf_greedy(hf, prompt: list[int], num_out: int = NUM_OUT) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_out, min_new_tokens=num_out, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(llm: LLM, prompts: list[list[int]], num_out: int = NUM_OUT):
    params = SamplingParams(temperature=0, max_tokens=num_out, ignore_eos=True)
    return llm.generate(prompts, params)


def test_a_batch_of_mixed_lengths_equals_transformers(checkpoint, monkeypatch):
    path, hf = checkpoint
    prompts = [prompt(n, i) for i, n in enumerate((3, 17, 1, 9))]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4)
    balances = _record_expert_balance(llm, monkeypatch)
    outs = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p) for p in prompts]
    llm.engine.check_integrity()
    assert balances and all(1.0 <= b <= 8 / 2 for b in balances)  # 8 experts, top-2: at most 4


def _record_expert_balance(llm: LLM, monkeypatch) -> list[float]:
    """The expert_balance of every engine step's stats, as the server's metrics get them."""
    balances, step = [], llm.engine.step

    def recording_step():
        outputs = step()
        if outputs.stats is not None and outputs.stats.expert_balance is not None:
            balances.append(outputs.stats.expert_balance)
        return outputs

    monkeypatch.setattr(llm.engine, "step", recording_step)
    return balances


def test_chunked_prefill_and_a_prefix_cache_hit_equal_transformers(checkpoint):
    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    shared = prompt(21, 7)
    first = greedy(llm, [shared])[0]  # 21 prompt tokens in chunks of at most 8
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, shared)
    longer = shared + prompt(6, 8)
    second = greedy(llm, [longer])[0]
    assert second.num_cached_tokens >= 20  # the shared prompt's 5 full blocks of 4
    assert list(second.outputs[0].token_ids) == hf_greedy(hf, longer)
    llm.engine.check_integrity()


def test_preemption_under_a_small_cache_equals_transformers(checkpoint):
    path, hf = checkpoint
    prompts = [prompt(n, 20 + i) for i, n in enumerate((20, 17, 22, 19))]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=33, block_size=4)  # 32 of 37 blocks
    outs = greedy(llm, prompts, num_out=16)
    assert llm.num_preemptions > 0, "the small pool was meant to force preemption"
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p, num_out=16) for p in prompts]
    llm.engine.check_integrity()


def test_ngram_speculation_over_an_moe_target_equals_transformers(checkpoint):
    path, hf = checkpoint
    repeated = prompt(8, 30) * 3
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, speculative="ngram",
              num_speculative_tokens=3)
    assert list(greedy(llm, [repeated])[0].outputs[0].token_ids) == hf_greedy(hf, repeated)
    llm.engine.check_integrity()


def test_the_sparse_layers_are_those_transformers_builds():
    """decoder_sparse_step and mlp_only_layers pick the same layers here as in transformers."""
    import transformers

    from llmserve.model.llama import CausalLM
    from llmserve.model.moe import SparseMoeBlock

    fields = {**_SHAPE, **ARCHS["qwen3_moe"][2], "num_hidden_layers": 6, "decoder_sparse_step": 2,
              "mlp_only_layers": [3]}
    config = transformers.Qwen3MoeConfig(**fields, architectures=["Qwen3MoeForCausalLM"])
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(config)
        ours = CausalLM(config)
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == hf_sparse
    assert hf_sparse == [False, True, False, False, False, True]


def test_tensor_parallelism_splits_the_experts(tmp_path):
    path = write_checkpoint("mixtral", str(tmp_path / "mixtral"))
    check_tensor_parallel(load_hf_config(path), 2)
    narrow = write_checkpoint("qwen3_moe", str(tmp_path / "narrow"), moe_intermediate_size=1)
    with pytest.raises(ValueError, match="tensor-parallel-size 2 exceeds the experts' intermediate size 1"):
        check_tensor_parallel(load_hf_config(narrow), 2)


def test_a_routing_field_this_layer_does_not_implement_is_refused_by_name(tmp_path):
    path = write_checkpoint("qwen3_moe", str(tmp_path / "sigmoid"), scoring_func="sigmoid")
    with pytest.raises(ValueError, match="scoring_func='sigmoid'"):
        load_model(path, torch.float32, "cpu")


def test_make_model_pairs_moe_archs_with_moe_shapes(tmp_path):
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts shape; MoE shapes: tiny-moe"):
        make_model("mixtral", "tiny", str(tmp_path / "a"))
    with pytest.raises(ValueError, match="'llama' needs a dense shape"):
        make_model("llama", "tiny-moe", str(tmp_path / "b"))
