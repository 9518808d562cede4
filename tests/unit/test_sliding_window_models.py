"""Sliding-window checkpoints: per-layer windows read from the config as transformers reads them, and greedy
tokens identical to transformers' `generate` with prompts several windows long, through chunked prefill
and a prefix-cache hit (float32, CPU: the torch backend with its C++ kernel)."""

from __future__ import annotations

from functools import partial

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

import hf_parity

from llmserve import LLM, SamplingParams
from llmserve.model.loader import load_model, load_model_info
from llmserve.testing.maker import make_model
from llmserve.model.sliding_window import layer_windows

WINDOW = 7  # not a multiple of the block size (4): some blocks lie partly in a window
NUM_OUT = 12

hf_greedy = partial(hf_parity.hf_greedy, num_out=NUM_OUT)
greedy = partial(hf_parity.engine_greedy, num_out=NUM_OUT)
prompt = partial(hf_parity.random_prompt, vocab_size=500)


CHECKPOINTS = {  # arch -> the window fields of its config, and the windows of its two layers
    "mistral": ({"sliding_window": WINDOW}, [WINDOW, WINDOW]),
    "qwen2": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, [0, WINDOW]),
}


def sliding_checkpoint(arch: str, fields: dict, folder) -> str:
    """A checkpoint transformers itself writes: make_model's tiny weights and tokenizer, its config class with
    the window fields (layer_types recomputed from them), the model class's save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = make_model(arch, "tiny", str(folder / "base"), seed=5)
    with open(os.path.join(base, "config.json")) as f:
        values = {k: v for k, v in json.load(f).items() if k != "layer_types"}
    config = AutoConfig.for_model(values.pop("model_type"), **{**values, **fields})
    out = str(folder / "swa")
    AutoModelForCausalLM.from_pretrained(base, config=config, dtype=torch.float32).save_pretrained(out)
    for name in os.listdir(base):  # tokenizer and generation config
        if not os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(base, name), out)
    return out


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    fields, windows = CHECKPOINTS[request.param]
    path = sliding_checkpoint(request.param, fields, tmp_path_factory.mktemp(request.param))
    return path, windows, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_layer_windows_match_transformers_layer_types(checkpoint):
    path, windows, hf = checkpoint
    model = load_model(path, torch.float32, "cpu")
    assert [layer.self_attn.window for layer in model.model.layers] == windows
    # Qwen2's attention holds its layer's window; Mistral's reads config.sliding_window in every layer
    hf_windows = [getattr(layer.self_attn, "sliding_window", hf.config.sliding_window) or 0
                  for layer in hf.model.layers]
    assert hf_windows == windows


def test_greedy_equals_transformers_through_chunks_and_a_prefix_hit(checkpoint):
    path, _, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=128, block_size=4, num_kv_blocks=96, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    prompts = [prompt(41, 1), prompt(5, 2), prompt(23, 3)]  # 41 tokens: three chunks of 16, six windows
    first = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in first] == [hf_greedy(hf, p) for p in prompts]
    longer = prompts[0] + first[0].outputs[0].token_ids + prompt(9, 4)  # its first 52 tokens are cached
    (hit,) = greedy(llm, [longer])
    assert hit.num_cached_tokens >= 48
    assert list(hit.outputs[0].token_ids) == hf_greedy(hf, longer)
    llm.engine.check_integrity()


def config(architecture: str = "MistralForCausalLM", num_layers: int = 3, **fields) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=num_layers, **fields)


@pytest.mark.parametrize("fields,architecture,expected", [
    ({"sliding_window": 8}, "MistralForCausalLM", [8, 8, 8]),
    ({"sliding_window": None}, "MistralForCausalLM", [0, 0, 0]),
    ({"sliding_window": 100}, "MistralForCausalLM", [0, 0, 0]),  # not shorter than the context: full
    ({"sliding_window": 8}, "LlamaForCausalLM", [0, 0, 0]),  # transformers' Llama reads no window
    ({"sliding_window": 8, "use_sliding_window": False, "max_window_layers": 0}, "Qwen2ForCausalLM", [0, 0, 0]),
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}, "Qwen2ForCausalLM", [0, 8, 8]),
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     "Qwen3ForCausalLM", [8, 0, 8]),
])
def test_layer_windows(fields, architecture, expected):
    assert layer_windows(config(**fields), architecture, max_model_len=100) == expected


@pytest.mark.parametrize("fields,match", [
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"sliding_window": 4.5}, "sliding_window must be a positive integer"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "full_attention"]},
     "layer_types: MistralForCausalLM"),
])
def test_mistral_configs_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        layer_windows(config(**fields), "MistralForCausalLM", max_model_len=100)


@pytest.mark.parametrize("layer_types,match", [
    (["sliding_attention", "chunked_attention", "full_attention"], "unsupported kinds"),
    (["sliding_attention"], "1 entries for 3 layers"),
])
def test_bad_layer_types_refused(layer_types, match):
    with pytest.raises(ValueError, match=match):
        layer_windows(config(sliding_window=8, layer_types=layer_types), "Qwen2ForCausalLM", max_model_len=100)


def test_disable_sliding_window_caps_the_context_to_the_window(checkpoint):
    """vLLM's --disable-sliding-window: full attention, max_model_len at most the window (where both agree)."""
    path, _, _ = checkpoint
    info = load_model_info("swa", path, torch.float32, disable_sliding_window=True)
    assert info.max_model_len == WINDOW
    assert load_model_info("swa", path, torch.float32, max_model_len=5, disable_sliding_window=True).max_model_len == 5
    with pytest.raises(ValueError, match="exceeds the sliding window 7"):
        load_model_info("swa", path, torch.float32, max_model_len=WINDOW + 1, disable_sliding_window=True)
    model = load_model(path, torch.float32, "cpu", info.max_model_len)
    assert [layer.self_attn.window for layer in model.model.layers] == [0, 0]


def test_triton_backend_greedy_equals_transformers(checkpoint):
    """The Triton kernel (its interpreter off CUDA) through the engine: one prompt of three windows."""
    pytest.importorskip("triton")
    path, windows, hf = checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=16 * len(set(windows)) + 1,
              max_num_batched_tokens=16, attention_backend="triton", device=device)
    tokens = prompt(21, 5)
    (out,) = greedy(llm, [tokens])
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, tokens)


def test_greedy_equals_transformers_through_preemption_and_an_abort(checkpoint):
    """A pool too small for the ten prompts at once: requests are preempted and recomputed, one is aborted
    mid-prompt; every block comes back. Where every layer slides (Mistral) a request holds only its window's
    blocks, so the same pool keeps more of them running; where it mixes them (Qwen2) each kind is a KV cache
    group, a max_model_len sequence's blocks in each."""
    path, windows, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=16 * len(set(windows)) + 1,
              max_num_batched_tokens=8, enable_prefix_caching=True)
    aborted = llm._add(prompt(30, 15), SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True), 0)
    for _ in range(2):
        llm.engine.step()
    llm.engine.abort_requests([aborted])
    prompts = [prompt(40, 11), prompt(33, 12), prompt(27, 13), prompt(45, 14)] + [prompt(5, 20 + i) for i in range(6)]
    outs = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p) for p in prompts]
    assert llm.num_preemptions > 0
    assert llm.engine.scheduler.kv.group_windows == tuple(sorted(set(windows)))  # mixed: a group of each kind
    llm.engine.check_integrity()
    pool = llm.engine.scheduler.kv.pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_graph_buffers_through_given_back_blocks(checkpoint):
    """Decode steps, and prompt chunks padded to 16 tokens, through the CUDA-graph buffers (decode and mixed-step,
    run eagerly off CUDA) of the Triton backend, with the blocks before the window given back: the captured
    block table holds stale or null ids there, never read. Here the mixed model's layers in one KV cache group
    (a table per group: tests/unit/test_hybrid_kv_cache.py)."""
    pytest.importorskip("triton")
    import graph_buffers

    path, _, hf = checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=32, max_num_batched_tokens=16,
              attention_backend="triton", device=device, enforce_eager=True, disable_hybrid_kv_cache_manager=True)
    decode_runs = graph_buffers.attach(llm.engine.runner, "decode", max_blocks=16)
    mixed_runs = graph_buffers.attach(llm.engine.runner, "mixed", max_blocks=16, max_tokens=16, max_rows=4)
    prompts = [prompt(21, 5)]
    outs = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p) for p in prompts]
    assert decode_runs and (16, 16) in mixed_runs
    llm.engine.check_integrity()
