"""Phi-3 checkpoints written by transformers itself (fused qkv_proj / gate_up_proj): logits of one forward and
greedy tokens equal transformers' through a mixed batch, chunked prefill and a prefix-cache hit, with a sliding
window and with LongRoPE plus partial rotary (Phi-4-mini's 0.75); LongRoPE's frequencies and attention factor
equal transformers' rope init; what the engine does not run is refused naming the field."""

from __future__ import annotations

from functools import partial

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

import hf_parity

from llmserve import LLM
from llmserve.model import phi3
from llmserve.testing import toy_tokenizer
from llmserve.model.attention import select_attention_backend
from llmserve.model.layers import rope_inv_freq, rope_params_from_config
from llmserve.model.loader import load_model
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

VOCAB = 512
WINDOW = 8
ORIGINAL = 64  # LongRoPE's original_max_position_embeddings
NUM_OUT = 8

hf_greedy = partial(hf_parity.hf_greedy, num_out=NUM_OUT)
greedy = partial(hf_parity.engine_greedy, num_out=NUM_OUT)
prompt = partial(hf_parity.random_prompt, vocab_size=VOCAB)


_FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, eos_token_id=2,
               pad_token_id=0, bos_token_id=None)
_LONGROPE = dict(original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,  # 12 of 16 features turn
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                                  "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})
VARIANTS = {"window": dict(sliding_window=WINDOW), "longrope": _LONGROPE}


def write_checkpoint(out_dir: str, seed: int = 0, **fields) -> str:
    """transformers' random Phi3ForCausalLM saved by save_pretrained, the toy tokenizer and a generation config
    without sampling defaults."""
    import transformers

    config = transformers.Phi3Config(**{**_FIELDS, **fields}, architectures=[phi3.ARCHITECTURE])
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # clearer argmaxes
    model.save_pretrained(out_dir)
    toy_tokenizer.save_tokenizer(out_dir, VOCAB, 256)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "pad_token_id": 0}, f)
    return out_dir


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(str(tmp_path_factory.mktemp(request.param)), seed=1, **VARIANTS[request.param])
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def our_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: one prefill step through a paged cache."""
    backend = select_attention_backend(torch.device("cpu"), "auto", torch.float32)
    input_ids, positions, inputs = PagedBatchBuilder(32, 4, seed=3).step([("a", tokens)])
    with torch.no_grad():
        hidden = model(input_ids, positions, allocate_kv_caches(model, 32, 4), backend.build_metadata(inputs), backend)
        return model.compute_logits(hidden)


def test_every_layer_slides_and_longrope_picks_its_factors_by_max_model_len(checkpoint):
    path, hf = checkpoint
    short, long = (load_model(path, torch.float32, "cpu", max_model_len=n) for n in (ORIGINAL, ORIGINAL + 1))
    windows = [WINDOW] * 2 if hf.config.sliding_window else [0, 0]
    assert [layer.self_attn.window for layer in short.model.layers] == windows
    if hf.config.rope_parameters["rope_type"] == "longrope":
        assert list(short.rotary["default"].params.ext_factors) == _LONGROPE["rope_parameters"]["short_factor"]
        assert list(long.rotary["default"].params.ext_factors) == _LONGROPE["rope_parameters"]["long_factor"]


def test_one_forward_equals_transformers(checkpoint):
    path, hf = checkpoint
    tokens = prompt(37, 0)  # several windows; within LongRoPE's original context (short factors on both sides)
    model = load_model(path, torch.float32, "cpu", max_model_len=ORIGINAL)
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(our_logits(model, tokens), theirs, atol=1e-4, rtol=0)


def test_a_batch_of_mixed_lengths_equals_transformers(checkpoint):
    path, hf = checkpoint
    prompts = [prompt(n, i) for i, n in enumerate((3, 29, 1, 17))]
    llm = LLM(path, dtype="float32", max_model_len=ORIGINAL, num_kv_blocks=64, block_size=4)
    outs = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p) for p in prompts]
    llm.engine.check_integrity()


def test_chunked_prefill_and_a_prefix_cache_hit_equal_transformers(checkpoint):
    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=ORIGINAL, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=8, enable_prefix_caching=True)
    shared = prompt(21, 7)
    (first,) = greedy(llm, [shared])
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, shared)
    longer = shared + prompt(6, 8)
    (second,) = greedy(llm, [longer])
    assert second.num_cached_tokens >= 20
    assert list(second.outputs[0].token_ids) == hf_greedy(hf, longer)
    llm.engine.check_integrity()


def test_long_factors_past_the_original_context_equal_transformers(tmp_path):
    """max_model_len > original_max_position_embeddings: the long factors from the first token; transformers
    uses them too once its sequence passes the original context, as with a prompt longer than it."""
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(str(tmp_path / "long"), seed=2, **_LONGROPE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    tokens = prompt(ORIGINAL + 6, 4)
    for _ in range(2):  # the second time through a prefix-cache hit
        (out,) = greedy(llm, [tokens])
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, tokens)
    assert out.num_cached_tokens >= ORIGINAL


@pytest.mark.parametrize("max_model_len,extra", [
    (ORIGINAL, {}), (ORIGINAL + 1, {}), (256, {"attention_factor": 1.3}), (256, {"factor": 8.0}),
])
def test_longrope_matches_transformers_rope_init(max_model_len, extra):
    """Frequencies (short up to the original context, long past it) and the attention factor equal
    transformers' `_compute_longrope_parameters`."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {**_LONGROPE, "rope_parameters": {**_LONGROPE["rope_parameters"], **extra}}
    config = Phi3Config(**{**_FIELDS, **fields}, architectures=[phi3.ARCHITECTURE])
    seq_len = ORIGINAL + 1 if max_model_len > ORIGINAL else None
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    params = rope_params_from_config(config, max_model_len)
    assert torch.equal(rope_inv_freq(16, params), hf_inv_freq)
    assert params.attention_scaling == pytest.approx(hf_scaling, rel=1e-12)
    if not extra:
        assert hf_scaling == pytest.approx(math.sqrt(1 + math.log(256 / ORIGINAL) / math.log(ORIGINAL)))


def test_phi3_old_su_name_reads_as_longrope():
    old = {k: v for k, v in _LONGROPE["rope_parameters"].items() if k != "rope_type"}
    config = SimpleNamespace(architectures=[phi3.ARCHITECTURE], max_position_embeddings=256, rope_theta=10000.0,
                             original_max_position_embeddings=ORIGINAL, rope_scaling={**old, "type": "su"})
    params = rope_params_from_config(config, max_model_len=ORIGINAL)
    assert params.rope_type == "longrope" and list(params.ext_factors) == _LONGROPE["rope_parameters"]["short_factor"]


def test_gelu_is_refused(tmp_path):
    path = write_checkpoint(str(tmp_path / "gelu"), hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        load_model(path, torch.float32, "cpu")


def test_factor_lists_of_the_wrong_length_are_refused():
    config = SimpleNamespace(architectures=[phi3.ARCHITECTURE], max_position_embeddings=256,
                             rope_parameters={**_LONGROPE["rope_parameters"], "partial_rotary_factor": 1.0,
                                              "original_max_position_embeddings": ORIGINAL})
    with pytest.raises(ValueError, match="short_factor/long_factor have 6 entries; the rotary dimension needs 8"):
        rope_inv_freq(16, rope_params_from_config(config))


def test_partial_rotary_of_another_architecture_is_refused():
    config = SimpleNamespace(architectures=["LlamaForCausalLM"], rope_parameters={"partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for LlamaForCausalLM"):
        rope_params_from_config(config)
