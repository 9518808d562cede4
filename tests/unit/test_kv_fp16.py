"""--kv-cache-dtype fp16 (issue 19): a float32 model's KV cache stored as float16. The CPU kernel reads it
(AVX2 + F16C, or the portable path) and the torch groups upcast it; both against the float64 reference over
the f16-rounded K/V (tight). The engine with it generates exactly what a float32 cache holding the
f16-rounded K/V generates, holds twice the blocks, and refuses the dtypes and devices nothing reads it on."""

from __future__ import annotations

import random

import pytest
import torch

from attention_cases import check_against_reference, make_case, random_rows, run_backend
from quant_cases import write_peaked

from llmserve import LLM, SamplingParams
from llmserve.config import CacheConfig, EngineConfig
from llmserve.model import cpu_kernels, quant
from llmserve.model.attn_torch import TorchAttentionBackend

MIXED_ROWS = [(40, 1), (0, 30), (7, 3), (0, 5), (60, 20), (99, 1), (0, 1), (33, 16)]
ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=160, enable_prefix_caching=False,
              max_num_batched_tokens=64)  # a 64-token budget: long prompts continue over cached chunks

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason="the C++ CPU kernel could not be built here (no compiler/ninja?)")


def _f16_case(rows, seed: int, head_dim: int = 64):
    """The float32 case with its cache stored as float16, and each row's full K/V rounded the same way."""
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed, head_dim=head_dim, num_blocks=256)
    rounded = [(fk.half().float(), fv.half().float()) for fk, fv in full]
    return q, k, v, kv_cache, inputs, rounded


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 40, 36])  # 64 unrolled, 40 AVX2 not unrolled, 36 the portable path
@pytest.mark.parametrize("seed", range(2))
def test_kernel_reads_f16_cache_as_f32_cache_of_rounded_values(head_dim, seed):
    q, k, v, kv_cache, inputs, rounded = _f16_case(random_rows(seed), seed, head_dim)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache.half(), inputs)
    assert metadata.kernel is not None and metadata.kernel.fallback == {}  # the kernel took the f16 cache
    check_against_reference(out, q, inputs.query_start_loc.tolist(), rounded, atol=1e-5)
    # the same float32 arithmetic over the same values: bit for bit what an f32 cache of them gives
    same, _ = run_backend(TorchAttentionBackend(), q, k.half().float(), v.half().float(), kv_cache.half().float(),
                          inputs)
    assert torch.equal(out, same)


@pytest.mark.parametrize("use_cpu_kernel", [False, None])
def test_torch_groups_read_f16_cache(use_cpu_kernel):
    """Fresh prompts, continuing chunks and (without the kernel) decode rows through SDPA over an f16 cache."""
    q, k, v, kv_cache, inputs, rounded = _f16_case(MIXED_ROWS, seed=3)
    out, _ = run_backend(TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel), q, k, v, kv_cache.half(), inputs)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), rounded, atol=1e-5)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    return write_peaked(str(tmp_path_factory.mktemp("peaked")))


def _greedy(llm, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_engine_fp16_kv_generates_as_f32_cache_of_rounded_kv(peaked, monkeypatch):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 150))] for _ in range(6)]
    llm = LLM(peaked, kv_cache_dtype="fp16", **ENGINE)
    assert llm.engine.runner.kv_caches[0].dtype == torch.float16
    got = _greedy(llm, prompts)
    forward = TorchAttentionBackend.forward

    def rounded_forward(self, q, k, v, kv_cache, metadata, scale, **layer):
        return forward(self, q, k.half().float(), v.half().float(), kv_cache, metadata, scale, **layer)

    monkeypatch.setattr(TorchAttentionBackend, "forward", rounded_forward)
    llm_f32 = LLM(peaked, **ENGINE)
    assert llm_f32.engine.runner.kv_caches[0].dtype == torch.float32
    assert got == _greedy(llm_f32, prompts)


def test_fp16_kv_cache_holds_twice_the_blocks_of_float32_for_the_same_bytes(peaked):
    blocks = {kv: LLM(peaked, dtype="float32", max_model_len=256, kv_cache_memory="4MiB",
                      kv_cache_dtype=kv).engine.num_blocks for kv in ("auto", "fp16")}
    assert blocks["fp16"] == 2 * blocks["auto"]


def test_fp16_kv_config_and_start_up_checks(peaked):
    EngineConfig(cache=CacheConfig(kv_cache_dtype="fp16")).validate()
    with pytest.raises(ValueError, match="--kv-cache-dtype: must be one of auto, fp8, fp16, int8; got 'f16'"):
        EngineConfig(cache=CacheConfig(kv_cache_dtype="f16")).validate()
    quant.check_supported(None, "fp16", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp16: supported for float32 models on CPU only.*"
                                         "runs bfloat16 on cpu: use auto$"):
        quant.check_supported(None, "fp16", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="runs float32 on cuda: use auto or fp8"):
        quant.check_supported(None, "fp16", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp16: supported for float32 models on CPU only"):
        LLM(peaked, dtype="bfloat16", max_model_len=256, num_kv_blocks=32, kv_cache_dtype="fp16")
