"""Gemma 3 text checkpoints written by transformers itself: one forward's logits equal transformers', greedy
tokens from the engine equal transformers' `generate` with prompts several sliding windows long, through a batch
of mixed lengths, chunked prefill, a prefix-cache hit and preemption; what the engine does not implement is
refused at load, naming the field."""

from __future__ import annotations

from functools import partial

import json
import shutil

import pytest
import torch

import hf_parity

from llmserve import LLM
from llmserve.testing import toy_tokenizer
from llmserve.model.loader import load_model
from llmserve.testing.maker import SHAPES, build_config

VOCAB = 512
WINDOW = 8  # the sliding layers' window; the engine's blocks hold 4 tokens
NUM_OUT = 8

hf_greedy = partial(hf_parity.hf_greedy, num_out=NUM_OUT)
greedy = partial(hf_parity.engine_greedy, num_out=NUM_OUT)
prompt = partial(hf_parity.random_prompt, vocab_size=VOCAB)


# three sliding layers then a full one (pattern 2); a local rope base far from the global one; the logits capped
_FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, max_position_embeddings=256,
               layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
               query_pre_attn_scalar=24, final_logit_softcapping=6.0, initializer_range=0.1, eos_token_id=2,
               pad_token_id=0, bos_token_id=None,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})


def write_checkpoint(out_dir: str, seed: int = 0, **fields) -> str:
    """transformers' random Gemma3ForCausalLM saved by save_pretrained, with the toy tokenizer; the norm weights
    (zeros after transformers' init) drawn at random so that they matter."""
    import transformers

    config = transformers.Gemma3TextConfig(**{**_FIELDS, **fields}, architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    toy_tokenizer.save_tokenizer(out_dir, VOCAB, 256)
    return out_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(str(tmp_path_factory.mktemp("gemma3")), seed=1)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_layers_slide_and_rotate_as_layer_types_says(checkpoint):
    path, hf = checkpoint
    model = load_model(path, torch.float32, "cpu")
    hf_windows = [layer.self_attn.sliding_window or 0 for layer in hf.model.layers]
    assert [layer.self_attn.window for layer in model.model.layers] == hf_windows == [WINDOW, WINDOW, 0, WINDOW]
    assert model.rope_kinds == hf.config.layer_types
    assert {kind: rotary.params.theta for kind, rotary in model.rotary.items()} == \
        {"sliding_attention": 100.0, "full_attention": 1000000.0}


def test_one_forward_equals_transformers_logits(checkpoint):
    """A prompt of several windows in one step: logits (soft-capped) equal transformers' in float32."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_model_parity import Runner, hf_logits

    path, hf = checkpoint
    tokens = prompt(29, 0)
    (ours,) = Runner(load_model(path, torch.float32, "cpu")).step([("a", tokens)])
    theirs = hf_logits(hf, tokens)
    assert theirs.abs().max() < 6.0  # capped
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_a_batch_of_mixed_lengths_equals_transformers(checkpoint):
    path, hf = checkpoint
    prompts = [prompt(n, i) for i, n in enumerate((3, 29, 1, 17))]  # up to three windows and a half
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=129, block_size=4)
    outs = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p) for p in prompts]
    llm.engine.check_integrity()


def test_chunked_prefill_and_a_prefix_cache_hit_equal_transformers(checkpoint):
    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=129, block_size=4, max_num_batched_tokens=8,
              enable_prefix_caching=True)
    shared = prompt(21, 7)
    (first,) = greedy(llm, [shared])  # 21 prompt tokens in chunks of at most 8
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, shared)
    longer = shared + prompt(6, 8)
    (second,) = greedy(llm, [longer])
    assert second.num_cached_tokens >= 20  # the shared prompt's 5 full blocks of 4
    assert list(second.outputs[0].token_ids) == hf_greedy(hf, longer)
    llm.engine.check_integrity()


def test_greedy_equals_transformers_through_preemption(checkpoint):
    """A pool too small for the prompts at once: requests are preempted and recomputed; the sliding and full
    layers in KV cache groups of their own (one layer each: three sliding groups, one full), and every block
    comes back."""
    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=32, max_num_batched_tokens=8,
              enable_prefix_caching=True)
    prompts = [prompt(40, 11), prompt(27, 13), prompt(33, 12), prompt(45, 14), prompt(38, 15), prompt(5, 20)]
    outs = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p) for p in prompts]
    assert llm.num_preemptions > 0
    assert llm.engine.scheduler.kv.group_windows == (0, WINDOW, WINDOW, WINDOW)
    llm.engine.check_integrity()
    pool = llm.engine.scheduler.kv.pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


@pytest.mark.parametrize("field, value, message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0 is not supported"),
    ("hidden_activation", "gelu", "hidden_activation='gelu' is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True is not supported"),
])
def test_what_is_not_implemented_is_refused(tmp_path, field, value, message):
    path = write_checkpoint(str(tmp_path / field), num_hidden_layers=1, layer_types=["full_attention"],
                            **{field: value})
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, "cpu")


def test_an_unknown_layer_kind_is_refused(checkpoint, tmp_path):
    """transformers' own model cannot be built with one: config.json edited after save_pretrained."""
    path, _ = checkpoint
    shutil.copytree(path, tmp_path / "chunked")
    config_file = tmp_path / "chunked" / "config.json"
    config = json.loads(config_file.read_text())
    config["layer_types"][1] = "chunked_attention"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer_types: unsupported kinds"):
        load_model(str(tmp_path / "chunked"), torch.float32, "cpu")


def test_make_model_shapes():
    """gemma-3-12b's config is the published one (the tiny shape's logits are checked in test_model_parity)."""
    config = build_config("gemma3", SHAPES["gemma-3-12b"], "bfloat16")
    published = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=256, sliding_window=1024, vocab_size=262208,
                     max_position_embeddings=131072, query_pre_attn_scalar=256, tie_word_embeddings=True,
                     final_logit_softcapping=None, attn_logit_softcapping=None)
    assert {k: getattr(config, k) for k in published} == published
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 8
    assert config.rope_parameters == {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                         "rope_theta": 1000000.0}}


def test_triton_backend_greedy_equals_transformers(checkpoint):
    """Windows and both rope tables through the Triton kernel (its interpreter off CUDA)."""
    pytest.importorskip("triton")
    path, hf = checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=65, max_num_batched_tokens=16,
              attention_backend="triton", device=device)
    tokens = prompt(13, 5)
    (out,) = greedy(llm, [tokens])
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, tokens)
