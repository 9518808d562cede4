"""The engine with --quantization and --kv-cache-dtype: greedy outputs independent of batching in each
format, an FP8 checkpoint served as written by make-model, and the start-up checks."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import CacheConfig, EngineConfig, ModelConfig
from llmserve.model import quant
from llmserve.testing.maker import make_model
from quant_cases import write_peaked

ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=160, enable_prefix_caching=False)
FORMATS = {"int8": dict(quantization="int8"), "fp8": dict(quantization="fp8"), "fp8-kv": dict(kv_cache_dtype="fp8")}


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    return write_peaked(str(tmp_path_factory.mktemp("peaked")))


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 60))] for _ in range(num)]


def _serve(llm, prompts, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_greedy_is_batching_invariant(peaked, fmt):
    """Each request alone and all together, chunked by a 64-token budget: the same greedy tokens."""
    prompts = _prompts(5, seed=1)
    llm = LLM(peaked, max_num_batched_tokens=64, **ENGINE, **FORMATS[fmt])
    together = _serve(llm, prompts, max_tokens=8)
    alone = [_serve(llm, [p], max_tokens=8)[0] for p in prompts]
    assert together == alone
    llm.engine.check_integrity()


def test_int8_greedy_mostly_matches_float32(peaked):
    prompts = _prompts(10, seed=2)
    ref = _serve(LLM(peaked, **ENGINE), prompts, max_tokens=8)
    got = _serve(LLM(peaked, quantization="int8", **ENGINE), prompts, max_tokens=8)
    first_tokens = sum(a[0] == b[0] for a, b in zip(ref, got))
    assert first_tokens >= 9, (ref, got)


def test_fp8_kv_cache_holds_twice_the_blocks_of_bfloat16_for_the_same_bytes(peaked):
    sizes = {}
    for kv in ("auto", "fp8"):
        llm = LLM(peaked, dtype="bfloat16", max_model_len=256, kv_cache_memory="4MiB", kv_cache_dtype=kv)
        sizes[kv] = llm.engine.num_blocks
        assert llm.engine.runner.kv_caches[0].dtype == (torch.bfloat16 if kv == "auto" else torch.float8_e4m3fn)
    assert sizes["fp8"] == 2 * sizes["auto"]


def test_fp8_checkpoint_from_make_model_serves(tmp_path):
    path = make_model("llama", "tiny", str(tmp_path / "m"), quantization="fp8")
    llm = LLM(path, **ENGINE)
    assert llm.engine.model_info.quantization == "fp8"
    assert len(_serve(llm, _prompts(2, seed=3))[1]) == 12


@pytest.mark.parametrize("config, message", [
    (EngineConfig(model=ModelConfig(quantization="int4")), "--quantization: must be one of int8, fp8, none"),
    (EngineConfig(cache=CacheConfig(kv_cache_dtype="int4")), "--kv-cache-dtype: must be one of auto, fp8, fp16, int8"),
    (EngineConfig(cache=CacheConfig(kv_cache_dtype="e5m2")), "--kv-cache-dtype: must be one of auto, fp8"),
])
def test_config_refuses_unknown_values(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_fp8_on_cuda_needs_16_bit_dtype_and_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        quant.check_supported("fp8", "auto", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8"):
        quant.check_supported(None, "fp8", torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        quant.check_supported("fp8", "auto", torch.device("cuda"), torch.float32)
    quant.check_supported("fp8", "fp8", torch.device("cuda"), torch.bfloat16)
    quant.check_supported("int8", "fp8", torch.device("cpu"), torch.float32)  # CPU: reference paths, allowed
