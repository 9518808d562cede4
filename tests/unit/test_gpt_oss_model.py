"""gpt-oss checkpoints written by transformers itself: greedy tokens from the engine equal transformers'
`generate` with prompts several sliding windows long, through a batch of mixed lengths, chunked prefill and a
prefix-cache hit; an MXFP4 checkpoint loads as transformers dequantizes it; what the engine cannot run yet is
refused at load, naming the reason."""

from __future__ import annotations

from functools import partial

import json
import os
import shutil

import pytest
import torch

import hf_parity

from llmserve import LLM
from llmserve.testing import toy_tokenizer
from llmserve.model.loader import load_model
from llmserve.testing.maker import SHAPES, build_config
from llmserve.model.quant import mxfp4

VOCAB = 512
WINDOW = 8  # the sliding layers' window; the engine's blocks hold 4 tokens
NUM_OUT = 8

hf_greedy = partial(hf_parity.hf_greedy, num_out=NUM_OUT)
greedy = partial(hf_parity.engine_greedy, num_out=NUM_OUT)
prompt = partial(hf_parity.random_prompt, vocab_size=VOCAB)


def _hf_reads_swiglu_fields() -> bool:
    """Older transformers (5.17, the GPU image's) runs every gpt-oss checkpoint with alpha 1.702 and limit 7.0,
    whatever its config says; there the checkpoints below carry those values, so that it stays the reference."""
    import inspect

    from transformers.models.gpt_oss import modeling_gpt_oss

    return "config.swiglu_alpha" in inspect.getsource(modeling_gpt_oss)


# a low limit where transformers reads it: the clamps act on these random weights
_SWIGLU = dict(swiglu_limit=0.5, swiglu_alpha=1.5) if _hf_reads_swiglu_fields() else dict(swiglu_limit=7.0,
                                                                                            swiglu_alpha=1.702)
_FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
               max_position_embeddings=256, initializer_range=0.1, eos_token_id=2, pad_token_id=0, bos_token_id=None,
               **_SWIGLU,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


def write_checkpoint(out_dir: str, seed: int = 0, **fields) -> str:
    """transformers' random GptOssForCausalLM saved by save_pretrained, with the toy tokenizer; the expert biases
    (zeros after transformers' init) and the sinks drawn at random so that they matter."""
    import transformers

    config = transformers.GptOssConfig(**{**_FIELDS, **fields}, architectures=["GptOssForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.1)
        model.lm_head.weight.mul_(3.0)  # clearer argmaxes
    model.save_pretrained(out_dir)
    toy_tokenizer.save_tokenizer(out_dir, VOCAB, 256)
    return out_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(str(tmp_path_factory.mktemp("gpt_oss")), seed=1)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_layers_slide_as_layer_types_says_and_carry_sinks(checkpoint):
    path, hf = checkpoint
    model = load_model(path, torch.float32, "cpu")
    hf_windows = [layer.self_attn.sliding_window or 0 for layer in hf.model.layers]
    assert [layer.self_attn.window for layer in model.model.layers] == hf_windows == [WINDOW, 0, WINDOW]
    for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)


def test_a_batch_of_mixed_lengths_equals_transformers(checkpoint):
    path, hf = checkpoint
    prompts = [prompt(n, i) for i, n in enumerate((3, 29, 1, 17))]  # up to three windows and a half
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=97, block_size=4)
    outs = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p) for p in prompts]
    llm.engine.check_integrity()


def test_chunked_prefill_and_a_prefix_cache_hit_equal_transformers(checkpoint):
    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=97, block_size=4, max_num_batched_tokens=8,
              enable_prefix_caching=True)
    shared = prompt(21, 7)
    (first,) = greedy(llm, [shared])  # 21 prompt tokens in chunks of at most 8
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, shared)
    longer = shared + prompt(6, 8)
    (second,) = greedy(llm, [longer])
    assert second.num_cached_tokens >= 20  # the shared prompt's 5 full blocks of 4
    assert list(second.outputs[0].token_ids) == hf_greedy(hf, longer)
    llm.engine.check_integrity()


def write_mxfp4_checkpoint(src: str, out_dir, seed: int) -> dict[str, torch.Tensor]:
    """src's checkpoint with its experts as random MXFP4 blocks and scales (quant_method mxfp4, as gpt-oss ships);
    returns the experts as transformers dequantizes them ([E, in, out] float32 by name)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(os.path.join(src, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        num_experts, num_in, num_out = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (num_experts, num_out, num_in // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(120, 125, (num_experts, num_out, num_in // 32), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    out_dir.mkdir()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out_dir / "config.json").write_text(json.dumps(config))
    for name in os.listdir(src):  # the tokenizer
        if not (out_dir / name).exists():
            shutil.copy(os.path.join(src, name), out_dir)
    return expected


def test_an_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = checkpoint
    expected = write_mxfp4_checkpoint(path, tmp_path / "mxfp4", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.load_state_dict(expected, strict=False)
    llm = LLM(str(tmp_path / "mxfp4"), dtype="float32", max_model_len=64, num_kv_blocks=49, block_size=4)
    tokens = prompt(19, 9)
    (out,) = greedy(llm, [tokens])
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, tokens)


def test_mxfp4_of_another_architecture_is_refused():
    from types import SimpleNamespace

    config = SimpleNamespace(architectures=["MixtralForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="'mxfp4' is read for GptOssForCausalLM only, not MixtralForCausalLM"):
        mxfp4.is_mxfp4(config)


def test_quantized_experts_keep_their_biases(checkpoint):
    """--quantization quantizes the experts (test_quant_moe.py); each expert's layers hold its biases."""
    path, _ = checkpoint
    float_block = load_model(path, torch.float32, "cpu").moe_blocks()[0]
    experts = load_model(path, torch.float32, "cpu", quantization="fp8").moe_blocks()[0].experts
    assert torch.equal(experts.gate_up_proj[1].bias, float_block.experts.gate_up_proj_bias[1])
    assert torch.equal(experts.down_proj[1].bias, float_block.experts.down_proj_bias[1])


def test_an_unknown_layer_kind_is_refused(tmp_path):
    path = write_checkpoint(str(tmp_path / "chunked"), layer_types=["sliding_attention", "chunked_attention",
                                                                    "full_attention"])
    with pytest.raises(ValueError, match="layer_types: unsupported kinds"):
        load_model(path, torch.float32, "cpu")


def test_make_model_shapes():
    """gpt-oss-20b's config is the published one (the tiny shape's logits are checked in test_model_parity)."""
    config = build_config("gpt_oss", SHAPES["gpt-oss-20b"], "bfloat16")
    published = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_local_experts=32,
                     num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                     sliding_window=128, vocab_size=201088, max_position_embeddings=131072, swiglu_limit=7.0,
                     attention_bias=True, tie_word_embeddings=False)
    assert {k: getattr(config, k) for k in published} == published
    assert config.layer_types == ["sliding_attention", "full_attention"] * 12
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


def test_triton_backend_greedy_equals_transformers(checkpoint):
    """Sinks and windows through the Triton kernel (its interpreter off CUDA): a prompt longer than a window."""
    pytest.importorskip("triton")
    path, hf = checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=49, max_num_batched_tokens=16,
              attention_backend="triton", device=device)
    tokens = prompt(13, 5)
    (out,) = greedy(llm, [tokens])
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, tokens)
