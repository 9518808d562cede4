"""Multi-head Latent Attention over the latent cache against a float64 reference that expands K and V per head
over each request's whole sequence: fresh prompt rows (the expanded form), rows continuing a cached prefix and
decode rows (the absorbed form over cached latents), in one step, with and without the C++ kernel's rows; a
float16 and an fp8 latent cache."""

from __future__ import annotations

import pytest
import torch

from mla_cases import KV_LORA, ROPE, make_step

from llmserve.model import cpu_kernels, mla
from llmserve.model.attention import FP8_KV_DTYPE
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


def test_int8_is_refused_for_a_latent_cache():
    mla.check_settings("fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype int8: the latent cache"):
        mla.check_settings("int8")
