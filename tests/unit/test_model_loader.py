"""Loader, registry, maker CLI and demo model: paths, dtypes, tokenizer, generation defaults, errors."""

from __future__ import annotations

import argparse
import hashlib
import logging
import json
import os
import time

import pytest
import torch

from llmserve.model import loader
from llmserve.model.demo import demo_model_path
from llmserve.model.loader import (ModelInfo, load_generation_defaults, load_model, load_model_info,
                                   load_tokenizer, resolve_dtype, resolve_model_path)
from llmserve.testing.maker import make_model
from llmserve.testing.maker_cli import add_make_model_parser
from llmserve.model.registry import SUPPORTED_ARCHITECTURES, get_model_class


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model("qwen2", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


def test_resolve_dtype():
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cuda") == torch.float16
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8", "cpu")


@pytest.mark.parametrize("flags,cap,dtype", [
    ({"avx2"}, None, torch.float32),  # bf16 would run ~100x slower than f32 here
    ({"avx512f", "avx512_bf16"}, None, torch.bfloat16),
    ({"avx512f", "amx_bf16"}, None, torch.bfloat16),
    ({"avx512f", "amx_bf16"}, "AVX2", torch.float32),  # oneDNN held to AVX2: no bf16 dot products
    ({"avx512f", "avx512_bf16"}, "AVX512_CORE", torch.float32),
    ({"avx512f", "avx512_bf16"}, "avx512_core_bf16", torch.bfloat16),
])
def test_resolve_dtype_auto_on_cpu_follows_bf16_flags_and_onednns_cap(pretend_cpu, flags, cap, dtype):
    pretend_cpu(flags, cap)
    assert resolve_dtype("auto", "cpu") == dtype


def test_local_dir_resolves_as_is_and_missing_dir_is_an_error(tiny_path, tmp_path):
    assert resolve_model_path(tiny_path, None) == tiny_path
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"), None)


@pytest.mark.parametrize("how", ["offline", "unreachable"])
def test_hub_id_that_cannot_be_fetched_is_a_fast_value_error(how, monkeypatch, tmp_path):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    if how == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(ValueError, match="no-such-org/no-such-model"):
        resolve_model_path("no-such-org/no-such-model", None)
    assert time.monotonic() - start < 20


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    assert set(SUPPORTED_ARCHITECTURES) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                            "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                                            "GptOssForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM",
                                            "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}


def test_tokenizer_decodes_every_id_and_applies_chat_template(tiny_path):
    tok = load_tokenizer(tiny_path)
    assert len(tok) == 512
    texts = [tok.decode([i]) for i in range(512)]
    assert all(isinstance(t, str) for t in texts)
    assert tok.decode(tok("Hello, world! 12:30")["input_ids"]) == "Hello, world! 12:30"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_a_prompt_past_the_model_length_tokenizes_without_transformers_warning(tiny_path):
    """The engine refuses it with its own error; transformers' "Token indices sequence length" is noise."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")  # its records stop there (propagate is off)
    transformers_logger.addHandler(handler)
    try:
        ids = load_tokenizer(tiny_path)("a b " * 2000)["input_ids"]
    finally:
        transformers_logger.removeHandler(handler)
    assert len(ids) > 2048  # the tiny model's max_position_embeddings
    assert not [r for r in records if "Token indices sequence length" in r.getMessage()]


def test_generation_defaults_and_model_info(tiny_path, tmp_path):
    defaults = load_generation_defaults(tiny_path)
    assert defaults["eos_token_id"] == [2, 0] and defaults["temperature"] == 0.7
    assert load_generation_defaults(str(tmp_path)) == {}
    info = load_model_info("tiny", tiny_path, torch.float32)
    assert info == ModelInfo(name="tiny", path=tiny_path, architecture="Qwen2ForCausalLM", vocab_size=512,
                             max_model_len=2048, eos_token_ids=[2, 0], num_layers=2, num_kv_heads=2, head_dim=16,
                             hidden_size=64, dtype="float32", layer_windows=(0, 0))
    assert load_model_info("tiny", tiny_path, torch.bfloat16, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len"):
        load_model_info("tiny", tiny_path, torch.float32, max_model_len=4096)


def test_load_model_in_bfloat16(tiny_path):
    model = load_model(tiny_path, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_or_unknown_tensors_are_errors(tiny_path):
    model = load_model(tiny_path, torch.float32, "cpu")
    weights = dict(loader.iter_safetensors(tiny_path))
    del weights["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        model.load_weights(weights.items())
    with pytest.raises(ValueError, match="has no place"):
        model.load_weights([("model.layers.0.self_attn.rope.weight", torch.zeros(1))])


def test_short_sliding_window_applies_unless_context_fits(tmp_path):
    path = make_model("mistral", "tiny", str(tmp_path), seed=0)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["sliding_window"] = 256
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    windows = lambda model: [layer.self_attn.window for layer in model.model.layers]  # noqa: E731
    assert windows(load_model(path, torch.float32, "cpu")) == [256, 256]
    assert windows(load_model(path, torch.float32, "cpu", max_model_len=256)) == [0, 0]  # the window hides nothing
    config["sliding_window"] = -1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        load_model(path, torch.float32, "cpu")


def _digest(path: str) -> str:
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_make_model_cli_is_deterministic(tmp_path):
    parser = argparse.ArgumentParser()
    add_make_model_parser(parser.add_subparsers())
    args = parser.parse_args(["make-model", "--arch", "qwen3", "--shape", "tiny", "--out", str(tmp_path / "a"),
                              "--seed", "7"])
    assert args.func(args) == 0
    make_model("qwen3", "tiny", str(tmp_path / "b"), seed=7)
    assert _digest(str(tmp_path / "a")) == _digest(str(tmp_path / "b"))
    make_model("qwen3", "tiny", str(tmp_path / "c"), seed=8)
    assert _digest(str(tmp_path / "a")) != _digest(str(tmp_path / "c"))


def test_demo_model_builds_once_and_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    path = demo_model_path()
    assert path == os.path.join(str(tmp_path), "demo-model-v3")
    assert os.listdir(tmp_path) == ["demo-model-v3"]  # no temp dir left behind
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert demo_model_path() == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    info = load_model_info("demo", path, torch.float32)
    assert (info.hidden_size, info.num_layers, info.vocab_size) == (256, 4, 2048)
    assert len(load_tokenizer(path)) == 2048


def test_sharded_checkpoint_loads_like_a_single_file(monkeypatch, tmp_path, tiny_path):
    from llmserve.testing import maker
    monkeypatch.setattr(maker, "_SHARD_BYTES", 40_000)
    sharded = make_model("qwen2", "tiny", str(tmp_path / "sharded"), seed=0)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2
    a, b = load_model(sharded, torch.float32, "cpu"), load_model(tiny_path, torch.float32, "cpu")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_chat_template_from_chat_template_jinja(tmp_path, tiny_path):
    import shutil
    path = str(tmp_path / "jinja")
    shutil.copytree(tiny_path, path)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    template = config.pop("chat_template")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(template)
    tok = load_tokenizer(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "yo"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("yo<|im_end|>\n<|im_start|>assistant\n")


def _top_gaps(path: str) -> torch.Tensor:
    """(top-1 minus top-2 logit) / the logits' std at every position of a random 64-token context."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits[0]  # [64, vocab]
    top = logits.topk(2, dim=-1).values  # [64, 2]
    return (top[:, 0] - top[:, 1]) / logits.std(dim=-1)


def test_peaked_logits_rescale_only_the_head_rows_and_open_the_top_gap(tmp_path):
    from safetensors.torch import load_file
    parser = argparse.ArgumentParser()
    add_make_model_parser(parser.add_subparsers())
    args = parser.parse_args(["make-model", "--shape", "tiny", "--out", str(tmp_path / "p"), "--peaked-logits"])
    assert args.func(args) == 0
    plain = load_file(os.path.join(make_model("llama", "tiny", str(tmp_path / "a")), "model.safetensors"))
    peaked = load_file(str(tmp_path / "p" / "model.safetensors"))
    assert [n for n in plain if not torch.equal(plain[n], peaked[n])] == ["lm_head.weight"]
    ratio = peaked["lm_head.weight"] / plain["lm_head.weight"]  # [vocab, hidden]: one positive scale a row
    assert (ratio > 0).all() and torch.allclose(ratio, ratio[:, :1].expand_as(ratio))
    gaps, plain_gaps = _top_gaps(str(tmp_path / "p")), _top_gaps(str(tmp_path / "a"))
    assert gaps.median() > 3 * plain_gaps.median()  # tiny: 1.30 against 0.24 logit standard deviations


def test_dummy_weights_need_only_the_config_and_tokenizer(tmp_path):
    """`make-model --no-weights` writes no safetensors; `--load-format dummy` builds the model with every weight
    uniform in [-1e-3, 1e-3] and serves it; the default load format names dummy when there are no weights."""
    from llmserve import LLM, SamplingParams

    path = make_model("qwen3", "tiny", str(tmp_path / "m"), has_weights=False)
    assert not [f for f in os.listdir(path) if f.endswith(".safetensors")]
    with pytest.raises(ValueError, match="--load-format dummy"):
        load_model(path, torch.float32, "cpu")
    model = load_model(path, torch.float32, "cpu", load_format="dummy")
    values = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert values.abs().max() <= 1e-3 and values.std() > 1e-4  # drawn, not left as they were
    llm = LLM(path, dtype="float32", load_format="dummy")
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="--no-weights"):
        make_model("llama", "tiny", str(tmp_path / "c"), has_weights=False, is_copying=True)
