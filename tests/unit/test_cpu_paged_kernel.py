"""The C++ CPU paged-attention kernel (llmserve.model.cpu_kernels) against the torch path and a naive
reference: random block tables, mixed lengths, GQA, decode and short multi-query rows."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from llmserve.model import cpu_kernels
from llmserve.model.attn_torch import TorchAttentionBackend
from llmserve.model.testing import PagedBatchBuilder

HEAD_DIM, NUM_KV_HEADS, NUM_BLOCKS = 64, 2, 4096
SCALE = HEAD_DIM ** -0.5


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    assert cpu_kernels._load() is None


def test_build_failure_falls_back(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("Error building extension 'llmserve_cpu_kernels': no compiler")

    monkeypatch.delenv("LLMSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger="llmserve.model.cpu_kernels"):
        assert cpu_kernels._load() is None
    assert "torch path" in caplog.text


needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason="the C++ CPU kernel could not be built here (no compiler/ninja?)")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One request: q [Q, H, D], its whole k/v [S, Hkv, D] -> [Q, H, D], in float64."""
    q, k, v = q.double(), k.double(), v.double()
    num_q, num_s, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * SCALE
    is_visible = torch.arange(num_s)[None, :] <= torch.arange(num_q)[:, None] + num_s - num_q
    probs = scores.masked_fill(~is_visible, float("-inf")).softmax(-1)
    return torch.einsum("hqs,shd->qhd", probs, v)


def make_case(rows: list[tuple[int, int]], block_size: int, group: int, seed: int, dtype=torch.float32):
    """rows: (cached tokens, new tokens) -> (q, k, v, kv_cache, inputs, per-row full k/v)."""
    gen = torch.Generator().manual_seed(seed)
    builder = PagedBatchBuilder(NUM_BLOCKS, block_size, seed=seed)
    kv_cache = torch.randn(2, NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    history = {}
    for req, (num_cached, _) in enumerate(rows):
        slots = torch.tensor(builder.add_cached(req, num_cached), dtype=torch.int64)
        history[req] = [kv_cache[i].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].clone() for i in range(2)]
    _, _, inputs = builder.step([(req, [0] * n) for req, (_, n) in enumerate(rows)])
    num_tokens = sum(n for _, n in rows)
    # q as a view into a fused qkv output, like the model's (non-contiguous rows)
    qkv = torch.randn(num_tokens, (group + 2) * NUM_KV_HEADS * HEAD_DIM, generator=gen).to(dtype)
    q = qkv[:, :group * NUM_KV_HEADS * HEAD_DIM].view(num_tokens, group * NUM_KV_HEADS, HEAD_DIM)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    starts = inputs.query_start_loc.tolist()
    full = [(torch.cat([history[r][0], k[starts[r]:starts[r + 1]]]), torch.cat([history[r][1], v[starts[r]:starts[r + 1]]]))
            for r in range(len(rows))]
    return q, k, v, kv_cache, inputs, full


def run_backend(backend, q, k, v, kv_cache, inputs):
    metadata = backend.build_metadata(inputs)
    return backend.forward(q, k, v, kv_cache.clone(), metadata, SCALE), metadata


def random_rows(seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    rows = [(rng.randint(0, 299), 1) for _ in range(rng.randint(5, 30))]  # decode: seq_len 1..300
    rows += [(rng.randint(1, 280), rng.randint(2, 16)) for _ in range(rng.randint(2, 6))]  # verification rows
    rows += [(0, 1)]  # a one-token prompt
    rng.shuffle(rows)
    return rows


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_torch_path_and_reference(block_size, group, seed):
    rows = random_rows(seed)
    q, k, v, kv_cache, inputs, full = make_case(rows, block_size, group, seed)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.kernel is not None and metadata.groups == []  # every row here is decode-like
    torch_out, torch_metadata = run_backend(TorchAttentionBackend(use_cpu_kernel=False), q, k, v, kv_cache, inputs)
    assert torch_metadata.kernel is None
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    starts = inputs.query_start_loc.tolist()
    for r, (full_k, full_v) in enumerate(full):
        expected = reference(q[starts[r]:starts[r + 1]], full_k, full_v).float()
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 4])
def test_kernel_rows_mixed_with_prefill_groups(block_size):
    """Decode-like rows go to the kernel, fresh prompts and long chunks stay on SDPA, one out."""
    rows = [(40, 1), (0, 20), (7, 3), (0, 5), (100, 30), (299, 1), (0, 1), (33, 16), (5, 17)]
    q, k, v, kv_cache, inputs, full = make_case(rows, block_size, 3, seed=11)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.kernel.rows.tolist() == [0, 2, 5, 6, 7]
    torch_out, _ = run_backend(TorchAttentionBackend(use_cpu_kernel=False), q, k, v, kv_cache, inputs)
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    starts = inputs.query_start_loc.tolist()
    for r, (full_k, full_v) in enumerate(full):
        expected = reference(q[starts[r]:starts[r + 1]], full_k, full_v).float()
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_writes_only_its_rows():
    rows = [(10, 1), (50, 4), (3, 1)]
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed=5)
    backend = TorchAttentionBackend()
    backend.forward(q, k, v, kv_cache, backend.build_metadata(inputs), SCALE)  # writes this step's k/v
    out = torch.full(q.shape, 7.0)
    cpu_kernels.paged_attention(out, q, kv_cache, inputs.block_table, inputs.seq_lens, inputs.query_start_loc,
                                torch.tensor([1], dtype=torch.int32), SCALE)
    assert bool((out[:1] == 7.0).all()) and bool((out[5:] == 7.0).all())
    torch.testing.assert_close(out[1:5], reference(q[1:5], *full[1]).float(), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_rejects_bad_metadata():
    rows = [(10, 1), (20, 1)]
    q, _, _, kv_cache, inputs, _ = make_case(rows, 16, 1, seed=1)
    out = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match="row index"):
        cpu_kernels.paged_attention(out, q, kv_cache, inputs.block_table, inputs.seq_lens, inputs.query_start_loc,
                                    torch.tensor([2], dtype=torch.int32), SCALE)
    too_long = torch.tensor([10, 4000], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_kernels.paged_attention(out, q, kv_cache, inputs.block_table, too_long, inputs.query_start_loc,
                                    torch.tensor([0, 1], dtype=torch.int32), SCALE)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_dtypes(dtype):
    rows = random_rows(7)
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed=7, dtype=dtype)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert out.dtype == dtype and metadata.kernel is not None
    starts = inputs.query_start_loc.tolist()
    for r, (full_k, full_v) in enumerate(full):
        expected = reference(q[starts[r]:starts[r + 1]], full_k, full_v).to(dtype)
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], expected, atol=2e-2, rtol=2e-2)


@needs_kernel
def test_unsupported_dtype_uses_torch_groups():
    rows = random_rows(3)
    q, k, v, kv_cache, inputs, full = make_case(rows, 4, 3, seed=3, dtype=torch.float64)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.kernel is not None and metadata.kernel.fallback is not None
    starts = inputs.query_start_loc.tolist()
    for r, (full_k, full_v) in enumerate(full):
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], reference(q[starts[r]:starts[r + 1]], full_k, full_v))


@needs_kernel
@pytest.mark.parametrize("num_threads", [1, 16])
def test_kernel_work_split_by_thread_count(num_threads):
    """Few rows per thread: one kv head per work item; many: all kv heads of a row per item."""
    rows = random_rows(num_threads)
    q, k, v, kv_cache, inputs, full = make_case(rows, 4, 3, seed=num_threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, _ = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    finally:
        torch.set_num_threads(previous)
    starts = inputs.query_start_loc.tolist()
    for r, (full_k, full_v) in enumerate(full):
        expected = reference(q[starts[r]:starts[r + 1]], full_k, full_v).float()
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], expected, atol=1e-5, rtol=1e-5)
