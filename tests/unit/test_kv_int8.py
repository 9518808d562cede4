"""--kv-cache-dtype int8 (issue 20): a float32 model's KV cache stored as int8, each token's kv head row with its
own float32 scale. The AVX2 attention kernel reads it against the float64 reference over the dequantized K/V
(tight); the kernels' write_kv stores exactly what the torch quantization gives; the engine with it
generates exactly what a float32 cache of the dequantized K/V generates, holds 4 D / (D + 4) times the
blocks, and refuses the dtypes, devices and builds nothing reads it on."""

from __future__ import annotations

import random

import pytest
import torch

from attention_cases import check_against_reference, make_case, random_rows, run_backend
from kv_int8_rows import dequantize_int8_rows
from quant_cases import write_peaked

from llmserve import LLM, SamplingParams
from llmserve.config import CacheConfig, EngineConfig, ModelConfig
from llmserve.model import cpu_kernels, quant
from llmserve.model.attention import quantize_int8_rows, write_kv
from llmserve.model.attn_torch import TorchAttentionBackend

MIXED_ROWS = [(40, 1), (0, 30), (7, 3), (0, 5), (60, 20), (99, 1), (0, 1), (33, 16)]
ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=160, enable_prefix_caching=False,
              max_num_batched_tokens=64)  # a 64-token budget: long prompts continue over cached chunks

needs_kernel = pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="CPU kernels without AVX2")


def _int8_case(rows, seed: int, head_dim: int):
    """The float32 case with its cache quantized to int8 rows, and each row's full K/V as the cache holds it."""
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed, head_dim=head_dim, num_blocks=256)
    stored = [(dequantize_int8_rows(quantize_int8_rows(fk)), dequantize_int8_rows(quantize_int8_rows(fv)))
              for fk, fv in full]
    return q, k, v, quantize_int8_rows(kv_cache), inputs, stored


def test_int8_rows_round_trip_within_half_a_step():
    x = torch.randn(5, 3, 24) * 4
    x[1, 2] = 0  # an all-zero row: scale 1, zeros back
    rows = quantize_int8_rows(x)
    assert rows.shape == (5, 3, 28) and rows.dtype == torch.int8
    back = dequantize_int8_rows(rows)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-6).all() and torch.equal(back[1, 2], torch.zeros(24))


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 40])  # 64 unrolled, 40 not
@pytest.mark.parametrize("seed", range(2))
def test_kernel_reads_int8_cache_as_its_dequantized_values(head_dim, seed):
    q, k, v, kv_cache, inputs, stored = _int8_case(random_rows(seed), seed, head_dim)
    out, metadata = run_backend(TorchAttentionBackend(kernel_takes_prompts=True), q, k, v, kv_cache, inputs)
    assert metadata.kernel is not None and not metadata.groups  # the kernel took every row
    check_against_reference(out, q, inputs.query_start_loc.tolist(), stored, atol=1e-5)
    # the same float32 arithmetic over the same values: bit for bit what an f32 cache of them gives
    k32, v32 = (dequantize_int8_rows(quantize_int8_rows(x)) for x in (k, v))
    same, _ = run_backend(TorchAttentionBackend(kernel_takes_prompts=True), q, k32, v32,
                          dequantize_int8_rows(kv_cache), inputs)
    assert torch.equal(out, same)


@needs_kernel
def test_kernel_takes_fresh_prompts_and_chunks_over_an_int8_cache():
    q, k, v, kv_cache, inputs, stored = _int8_case(MIXED_ROWS, 3, 64)
    out, _ = run_backend(TorchAttentionBackend(kernel_takes_prompts=True), q, k, v, kv_cache, inputs)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), stored, atol=1e-5)


def test_rows_left_to_torch_refuse_an_int8_cache():
    q, k, v, kv_cache, inputs, _ = _int8_case(MIXED_ROWS, 3, 64)
    with pytest.raises(RuntimeError, match="int8 KV cache is read by the CPU attention kernel only"):
        run_backend(TorchAttentionBackend(use_cpu_kernel=False), q, k, v, kv_cache, inputs)


@needs_kernel
def test_fused_write_stores_what_the_torch_quantization_gives():
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(2, 4, 16, 3, 20, dtype=torch.int8)
    k, v = torch.randn(10, 3, 16, generator=gen) * 3, torch.randn(10, 3, 16, generator=gen)
    k[2, 1] = 0
    slots = torch.tensor([5, 0, 17, 63, 8, 9, 30, 31, 40, 41])
    fused, plain = cache.clone(), cache.clone()
    with torch.inference_mode():  # where cpu_kernels.can_fuse: the kernels' write_kv
        write_kv(fused, slots, k, v)
    write_kv(plain, slots, k, v)  # torch: quantize_int8_rows + index_copy_
    assert torch.equal(fused, plain)
    assert torch.equal(dequantize_int8_rows(fused[0].view(-1, 3, 20)[slots]),
                       dequantize_int8_rows(quantize_int8_rows(k)))


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    return write_peaked(str(tmp_path_factory.mktemp("peaked")))


@needs_kernel
def test_engine_int8_kv_generates_as_f32_cache_of_dequantized_kv(peaked, monkeypatch):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 150))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(peaked, kv_cache_dtype="int8", **ENGINE)
    assert llm.engine.runner.kv_caches[0].dtype == torch.int8
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    plain = [o.outputs[0].token_ids for o in LLM(peaked, **ENGINE).generate(prompts, params)]
    assert sum(a == b for x, y in zip(got, plain) for a, b in zip(x, y)) >= 0.9 * 60  # near float32's
    forward = TorchAttentionBackend.forward

    def dequantized_forward(self, q, k, v, kv_cache, metadata, scale, **layer):
        k, v = (dequantize_int8_rows(quantize_int8_rows(x)) for x in (k, v))
        return forward(self, q, k, v, kv_cache, metadata, scale, **layer)

    monkeypatch.setattr(TorchAttentionBackend, "forward", dequantized_forward)
    rounded = [o.outputs[0].token_ids for o in LLM(peaked, **ENGINE).generate(prompts, params)]
    assert got == rounded  # the kernel's float32 arithmetic over the same values


@needs_kernel
def test_int8_kv_cache_holds_four_times_the_blocks_less_its_scales(peaked):
    blocks = {kv: LLM(peaked, dtype="float32", max_model_len=256, kv_cache_memory="4MiB",
                      kv_cache_dtype=kv).engine.num_blocks for kv in ("auto", "int8")}
    head_dim = 32  # the peaked checkpoint's: int8 rows of 32 + 4 bytes against 128
    assert blocks["int8"] == (blocks["auto"] * 4 * head_dim) // (head_dim + 4)


def test_int8_kv_config_and_start_up_checks(monkeypatch):
    EngineConfig(cache=CacheConfig(kv_cache_dtype="int8")).validate()
    with pytest.raises(ValueError, match="--kv-cache-dtype: int8 is read by the CPU attention kernel only"):
        EngineConfig(model=ModelConfig(attention_backend="triton"), cache=CacheConfig(kv_cache_dtype="int8")).validate()
    monkeypatch.setattr(cpu_kernels, "has_avx2_kernels", lambda: True)
    quant.check_supported(None, "int8", torch.device("cpu"), torch.float32, head_dim=64)
    with pytest.raises(ValueError, match="--kv-cache-dtype int8: supported for float32 models on CPU .* runs "
                                         "bfloat16 on cpu: use auto$"):
        quant.check_supported(None, "int8", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="runs float32 on cuda: use auto or fp8$"):
        quant.check_supported(None, "int8", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="head_dim a multiple of 8; this model's is 36"):
        quant.check_supported(None, "int8", torch.device("cpu"), torch.float32, head_dim=36)
    monkeypatch.setattr(cpu_kernels, "has_avx2_kernels", lambda: False)
    with pytest.raises(ValueError, match="runs float32 on cpu without them: use auto or fp16$"):
        quant.check_supported(None, "int8", torch.device("cpu"), torch.float32)
