"""The C++ CPU paged-attention kernel with few rows over long contexts: each (row, kv head) is cut into splits
over its keys, attended on several threads and merged by their maxima (csrc/paged_attention_split.cpp). With
one or two rows and 2+ threads the work items (a row's kv heads) are fewer than four a thread, so every case
here goes through the splits; the float64 reference and the same call on one thread (no splits) check them."""

from __future__ import annotations

import pytest
import torch

from llmserve.model import cpu_kernels
from attention_cases import check_against_reference, make_case, run_backend
from llmserve.model.attn_torch import TorchAttentionBackend

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="the C++ CPU kernel could not be built here (no compiler/ninja?)")

# (cached tokens, new tokens): odd lengths over many blocks; a verification-like row of 5 queries
FEW_ROWS = {"one decode row": [(1000, 1)], "two decode rows": [(777, 1), (130, 1)],
            "a short and a long row": [(20, 1), (1501, 1)], "multi-query row": [(613, 5)]}


def _attend(rows, num_threads: int, dtype=torch.float32, head_dim: int = 64, group: int = 3, block_size: int = 16,
            **layer):
    q, k, v, kv_cache, inputs, full = make_case(rows, block_size, group, seed=len(rows) + head_dim, dtype=dtype,
                                                head_dim=head_dim)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, metadata = run_backend(TorchAttentionBackend(kernel_takes_prompts=True), q, k, v, kv_cache, inputs,
                                    **layer)
    finally:
        torch.set_num_threads(previous)
    assert metadata.kernel is not None and metadata.groups == []
    return out, q, inputs.query_start_loc.tolist(), full


@pytest.mark.parametrize("case", FEW_ROWS)
@pytest.mark.parametrize("num_threads", [2, 3, 8])
@pytest.mark.parametrize("group", [1, 3])
def test_splits_match_the_reference_and_one_thread(case, num_threads, group):
    out, q, starts, full = _attend(FEW_ROWS[case], num_threads, group=group)
    check_against_reference(out, q, starts, full, atol=1e-5)
    unsplit, *_ = _attend(FEW_ROWS[case], 1, group=group)
    torch.testing.assert_close(out, unsplit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", FEW_ROWS)
@pytest.mark.parametrize("window", [300, 40, 5000])
def test_splits_under_a_sliding_window_with_sinks(case, window):
    """Splits cover only the window's keys (300: several splits, 40: too few keys to split); sinks join the
    merged denominator once."""
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(window))
    out, q, starts, full = _attend(FEW_ROWS[case], 2, window=window, sinks=sinks)
    check_against_reference(out, q, starts, full, atol=1e-5, window=window, sinks=sinks)


@pytest.mark.parametrize("dtype,head_dim,atol", [(torch.bfloat16, 64, 2e-2), (torch.bfloat16, 36, 2e-2),
                                                 (torch.float16, 64, 2e-2), (torch.float32, 36, 1e-5)])
@pytest.mark.parametrize("case", ["one decode row", "multi-query row"])
def test_splits_in_half_dtypes_and_on_the_portable_path(dtype, head_dim, atol, case):
    """bfloat16 (AVX2 path, widened exactly), and the portable kernel (float16, a head_dim the AVX2 path does not
    take) split alike."""
    out, q, starts, full = _attend(FEW_ROWS[case], 2, dtype=dtype, head_dim=head_dim)
    assert out.dtype == dtype
    check_against_reference(out, q, starts, full, atol=atol)


def test_splits_over_a_float16_cache_of_a_float32_model():
    rows = FEW_ROWS["two decode rows"]
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed=3)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, _ = run_backend(TorchAttentionBackend(), q, k, v, kv_cache.half(), inputs)
    finally:
        torch.set_num_threads(previous)
    rounded = [(fk.half().float(), fv.half().float()) for fk, fv in full]
    check_against_reference(out, q, inputs.query_start_loc.tolist(), rounded, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="an int8 cache needs the AVX2 kernels")
def test_splits_over_an_int8_cache():
    from kv_int8_rows import dequantize_int8_rows
    from llmserve.model.attention import quantize_int8_rows

    rows = FEW_ROWS["a short and a long row"]
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed=5)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, _ = run_backend(TorchAttentionBackend(kernel_takes_prompts=True), q, k, v, quantize_int8_rows(kv_cache),
                             inputs)
    finally:
        torch.set_num_threads(previous)
    stored = [tuple(dequantize_int8_rows(quantize_int8_rows(x)) for x in kv) for kv in full]
    check_against_reference(out, q, inputs.query_start_loc.tolist(), stored, atol=1e-5)
