"""Multi-head Latent Attention over the latent cache against a float64 reference that expands K and V per head
over each request's whole sequence: fresh prompt rows (the expanded form), rows continuing a cached prefix and
decode rows (the absorbed form over cached latents), in one step, with and without the C++ kernel's rows; a
float16, an fp8 and an int8 latent cache."""

from __future__ import annotations

import pytest
import torch

from kv_int8_rows import dequantize_int8_rows
from mla_cases import KV_LORA, ROPE, make_step, stored

from llmserve.model import cpu_kernels
from llmserve.model.attention import FP8_KV_DTYPE, quantize_int8_rows
from llmserve.model.attn_torch import TorchAttentionBackend


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize(("use_cpu_kernel", "kernel_takes_prompts", "dtype", "tolerance"), [
    (False, False, torch.float64, 1e-10),  # torch groups only
    (None, False, torch.float32, 1e-5),  # the C++ kernel's decode-like rows, groups for the prompts
    (None, True, torch.float32, 1e-5),  # the C++ kernel's every row
])
def test_fresh_continuing_and_decode_rows_equal_per_head_attention(q_lora_rank, use_cpu_kernel, kernel_takes_prompts,
                                                                   dtype, tolerance):
    if use_cpu_kernel is None and not cpu_kernels.available():
        pytest.skip("the C++ kernels do not build here")
    step = make_step(q_lora_rank)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel, kernel_takes_prompts=kernel_takes_prompts)
    attention, cache = step.attention.to(dtype), step.cache.to(dtype)
    with torch.no_grad():
        metadata = backend.build_metadata(step.inputs)
        out = attention(step.new_x.to(dtype), tuple(t.to(dtype) for t in step.cos_sin), cache, metadata, backend)
    torch.testing.assert_close(out.double(), step.expected, rtol=tolerance, atol=tolerance)
    assert cache.view(-1, KV_LORA + ROPE)[step.inputs.slot_mapping].abs().sum() > 0  # the new entries were stored


@pytest.mark.parametrize("use_cpu_kernel", [False, None])
@pytest.mark.parametrize(("cache_dtype", "tolerance"), [(torch.float16, 2e-3), (FP8_KV_DTYPE, 3e-2)])
def test_a_float16_or_fp8_latent_cache_equals_attention_over_the_rounded_entries(use_cpu_kernel, cache_dtype,
                                                                               tolerance):
    """--kv-cache-dtype fp16 / fp8 for a float32 model: entries stored rounded (fp8: scale 1, saturated), widened
    as read; the C++ kernel reads a float16 cache, an fp8 one goes to the torch groups."""
    if use_cpu_kernel is None and not cpu_kernels.available():
        pytest.skip("the C++ kernels do not build here")
    step = make_step(12, cache_dtype=cache_dtype)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel, kernel_takes_prompts=True)
    attention, cache = step.attention.float(), step.cache.to(cache_dtype)
    with torch.no_grad():
        metadata = backend.build_metadata(step.inputs)
        out = attention(step.new_x.float(), tuple(t.float() for t in step.cos_sin), cache, metadata, backend)
    assert cache.dtype == cache_dtype
    torch.testing.assert_close(out.double(), step.expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("use_cpu_kernel", "dtype", "tolerance"), [
    (False, torch.float64, 1e-10),  # torch groups: the reference's own arithmetic over the same entries
    (None, torch.float32, 1e-5),  # the C++ kernel's every row (AVX2 builds)
])
def test_an_int8_latent_cache_equals_attention_over_its_dequantized_entries(use_cpu_kernel, dtype, tolerance):
    """--kv-cache-dtype int8: each entry [L + R] quantized with its own float32 scale (4 more bytes); the fresh
    prompt rows read their own entries so rounded too, the float64 reference expands K and V from the dequantized
    entries."""
    if use_cpu_kernel is None and not cpu_kernels.has_avx2_kernels():
        pytest.skip("the C++ kernels' AVX2 build reads an int8 cache")
    step = make_step(12, cache_dtype=torch.int8)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel, kernel_takes_prompts=True)
    attention, cache = step.attention.to(dtype), stored(step.cache, torch.int8)
    assert cache.shape[-1] == KV_LORA + ROPE + 4
    with torch.no_grad():
        metadata = backend.build_metadata(step.inputs)
        out = attention(step.new_x.to(dtype), tuple(t.to(dtype) for t in step.cos_sin), cache, metadata, backend)
        entries = attention._latent_entries(step.new_x.to(dtype), tuple(t.to(dtype) for t in step.cos_sin))
    if use_cpu_kernel is None:
        assert metadata.kernel is not None and not metadata.groups_for(0)  # the kernel took every row
    torch.testing.assert_close(out.double(), step.expected, rtol=tolerance, atol=tolerance)
    new_entries = cache.view(-1, KV_LORA + ROPE + 4)[step.inputs.slot_mapping]
    assert torch.equal(new_entries, quantize_int8_rows(entries.float()))


@pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="the C++ kernels' AVX2 build reads an int8 cache")
def test_the_kernel_reads_an_int8_latent_cache_as_a_float32_cache_of_its_dequantized_entries():
    """Bit for bit: the same float32 arithmetic over the same values, the step's own entries included."""
    step = make_step(12, cache_dtype=torch.int8)
    backend = TorchAttentionBackend(kernel_takes_prompts=True)
    attention, cos_sin, x = step.attention.float(), tuple(t.float() for t in step.cos_sin), step.new_x.float()
    int8_cache = stored(step.cache, torch.int8)
    float_cache = dequantize_int8_rows(int8_cache)
    latent_entries = attention._latent_entries
    with torch.no_grad():
        out = attention(x, cos_sin, int8_cache, backend.build_metadata(step.inputs), backend)
        attention._latent_entries = lambda *a: dequantize_int8_rows(quantize_int8_rows(latent_entries(*a)))
        same = attention(x, cos_sin, float_cache, backend.build_metadata(step.inputs), backend)
    assert torch.equal(out, same)
    assert torch.equal(dequantize_int8_rows(int8_cache), float_cache)
