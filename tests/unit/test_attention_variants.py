"""Sliding windows and attention sinks in every attention backend, against the float64 reference.

Rows mix decode tokens, prompts longer than the window, chunks over a cached prefix and 16-token tiles;
windows are shorter than the prompts and not multiples of the block size. The backends (torch's gather, C++
on CPU, Triton through its interpreter off CUDA) must not read blocks wholly before a row's window: those
hold NaN here.
"""

from __future__ import annotations

import pytest
import torch

from attention_cases import check_against_reference, make_case, run_backend
from kv_int8_rows import dequantize_int8_rows

from llmserve.model import cpu_kernels
from llmserve.model.attention import FP8_KV_DTYPE, quantize_int8_rows
from llmserve.model.attn_torch import TorchAttentionBackend

ROWS = [(40, 1), (0, 37), (7, 3), (0, 5), (100, 30), (61, 1), (0, 1), (33, 16), (5, 17), (15, 1)]
WINDOWS = [1, 5, 24]
needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ CPU kernel could not be built here")


def random_sinks(num_heads: int, seed: int) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2  # [H] float32


def poison_out_of_window_blocks(kv_cache: torch.Tensor, inputs, window: int) -> torch.Tensor:
    """A copy of kv_cache whose blocks wholly before each row's first query's window hold NaN."""
    poisoned = kv_cache.clone()
    block_size = inputs.block_size
    for row, (q_len, seq_len) in enumerate(zip(inputs.query_lens_cpu, inputs.seq_lens_cpu)):
        first_key = max(0, seq_len - q_len - window + 1)
        for b in range(first_key // block_size):
            poisoned[:, int(inputs.block_table[row, b])] = float("nan")
    return poisoned


def check_backend(backend, window: int, has_sinks: bool, block_size: int = 4, dtype=torch.float32,
                  head_dim: int = 64, atol: float = 1e-5, is_poisoned: bool = False, device: str = "cpu",
                  rows: list[tuple[int, int]] = ROWS):
    q, k, v, kv_cache, inputs, full = make_case(rows, block_size, 3, seed=window + block_size, dtype=dtype,
                                                head_dim=head_dim, num_blocks=512)
    sinks = random_sinks(q.shape[1], window) if has_sinks else None
    if is_poisoned:
        kv_cache = poison_out_of_window_blocks(kv_cache, inputs, window)
    if device != "cpu":
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            setattr(inputs, name, getattr(inputs, name).to(device))
        q, k, v, kv_cache = q.to(device), k.to(device), v.to(device), kv_cache.to(device)
        sinks = None if sinks is None else sinks.to(device)
    out, metadata = run_backend(backend, q, k, v, kv_cache, inputs, window=window, sinks=sinks)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=atol, window=window, sinks=sinks)
    return metadata


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("has_sinks", [False, True])
def test_torch_path(window, has_sinks):
    """SDPA (or the sinks' math path) over the blocks from each row's window on: NaN before them is not read."""
    metadata = check_backend(TorchAttentionBackend(use_cpu_kernel=False), window, has_sinks, is_poisoned=True)
    assert metadata.kernel is None and window in metadata.windowed


def test_torch_path_window_longer_than_every_row_is_full_attention():
    metadata = check_backend(TorchAttentionBackend(use_cpu_kernel=False), 1000, False)
    assert metadata.windowed == {}


@needs_kernel
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("has_sinks", [False, True])
def test_kernel_rows_with_sdpa_groups(window, has_sinks):
    """Decode-like rows on the C++ kernel, the prompts and long chunks on SDPA, one layer call."""
    metadata = check_backend(TorchAttentionBackend(), window, has_sinks)
    assert metadata.kernel is not None and metadata.groups


@needs_kernel
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("has_sinks", [False, True])
@pytest.mark.parametrize("block_size", [4, 6])  # 6: the kernel's division path
def test_kernel_takes_every_row_and_skips_blocks_out_of_the_window(window, has_sinks, block_size):
    """Every row on the kernel (float32, head_dim 64: the AVX2 path where built) with NaN before the windows."""
    metadata = check_backend(TorchAttentionBackend(kernel_takes_prompts=True), window, has_sinks, block_size,
                             is_poisoned=True)
    assert metadata.groups == []


@needs_kernel
@pytest.mark.parametrize("num_threads", [1, 16])  # 16: one kv head per work item (sinks indexed per item)
def test_kernel_work_split_by_thread_count(num_threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        check_backend(TorchAttentionBackend(kernel_takes_prompts=True), 5, True, is_poisoned=True)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="an int8 cache needs the AVX2 kernels")
def test_kernel_over_an_int8_cache():
    q, k, v, kv_cache, inputs, full = make_case(ROWS, 4, 3, seed=2, num_blocks=512)
    stored = [tuple(dequantize_int8_rows(quantize_int8_rows(x)) for x in pair) for pair in full]
    sinks = random_sinks(q.shape[1], 2)
    out, _ = run_backend(TorchAttentionBackend(kernel_takes_prompts=True), q, k, v, quantize_int8_rows(kv_cache),
                         inputs, window=5, sinks=sinks)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), stored, atol=1e-5, window=5, sinks=sinks)


@needs_kernel
def test_fp8_cache_falls_back_to_windowed_torch_groups():
    """The kernel takes no fp8 cache: its rows go to torch groups built for the layer's window."""
    q, k, v, kv_cache, inputs, full = make_case(ROWS, 4, 3, seed=3, num_blocks=512)
    stored = [tuple(x.to(FP8_KV_DTYPE).float() for x in pair) for pair in full]
    sinks = random_sinks(q.shape[1], 3)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache.to(FP8_KV_DTYPE), inputs, window=5,
                                sinks=sinks)
    assert 5 in metadata.kernel.fallback
    check_against_reference(out, q, inputs.query_start_loc.tolist(), stored, atol=1e-5, window=5, sinks=sinks)


@needs_kernel
@pytest.mark.parametrize("dtype,head_dim,atol", [(torch.float32, 36, 1e-5), (torch.bfloat16, 64, 2e-2)])
@pytest.mark.parametrize("has_sinks", [False, True])
def test_kernel_portable_path(dtype, head_dim, atol, has_sinks):
    """head_dim not a multiple of 8 or a half dtype: the portable C++ path, NaN before the windows."""
    check_backend(TorchAttentionBackend(kernel_takes_prompts=True), 5, has_sinks, dtype=dtype, head_dim=head_dim,
                  atol=atol, is_poisoned=True)


@needs_kernel
def test_kernel_rejects_bad_window_and_sinks():
    q, _, _, kv_cache, inputs, _ = make_case([(3, 1)], 4, 1, seed=0, num_blocks=8)
    rows = torch.tensor([0], dtype=torch.int32)
    args = (torch.empty_like(q), q, kv_cache, inputs.block_table, inputs.seq_lens, inputs.query_start_loc, rows, 0.1)
    with pytest.raises(RuntimeError, match="window"):
        cpu_kernels.paged_attention(*args, window=-1)
    with pytest.raises(RuntimeError, match="sinks"):
        cpu_kernels.paged_attention(*args, sinks=torch.zeros(q.shape[1] + 1))


@pytest.mark.parametrize("window,has_sinks,rows", [(5, False, ROWS), (24, True, ROWS), (0, True, ROWS),
                                                   (3, True, [(40, 1), (0, 1), (9, 1)])])  # decode only: 1-query tiles
def test_triton_kernel(window, has_sinks, rows):
    pytest.importorskip("triton")  # without CUDA, conftest.py set TRITON_INTERPRET=1 before anything imported it
    from llmserve.model.attn_triton import TritonAttentionBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_backend(TritonAttentionBackend(), window, has_sinks, is_poisoned=window > 0, device=device, rows=rows)


@pytest.mark.parametrize("window,has_sinks", [(0, True), (24, True), (5, False)])
def test_triton_kernel_splitting_the_keys(window, has_sinks, monkeypatch):
    """Decode rows whose keys the kernel splits into 4 parts merged afterwards (flash decoding): the same
    reference, windows and sinks included, no block before a window read."""
    pytest.importorskip("triton")
    import dataclasses

    from llmserve.model import triton_kernels
    from llmserve.model.attn_triton import TritonAttentionBackend

    class SplittingBackend(TritonAttentionBackend):
        def build_metadata(self, inputs):
            return dataclasses.replace(super().build_metadata(inputs), split_keys=True)

    monkeypatch.setattr(triton_kernels, "num_splits_for", lambda *args: 4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_backend(SplittingBackend(), window, has_sinks, is_poisoned=window > 0, device=device,
                  rows=[(40, 1), (0, 1), (9, 1), (130, 1), (299, 1)])
