"""Multi-head Latent Attention over the latent cache against a float64 reference that expands K and V per head
over each request's whole sequence: fresh prompt rows (the expanded form), rows continuing a cached prefix and
decode rows (the absorbed form over cached latents), in one step, with and without the C++ kernel's rows."""

from __future__ import annotations

import pytest
import torch

from mla_cases import KV_LORA, ROPE, make_step

from llmserve.model import cpu_kernels
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
