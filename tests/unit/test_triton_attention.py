"""The Triton paged-attention kernel (model.triton_kernels) against a float64 reference and the torch
backend: random block tables, partial blocks, cached prefixes, GQA with a non-power-of-2 group, head
dims that are not a power of 2. On CUDA it runs compiled; elsewhere through Triton's interpreter."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # without CUDA, conftest.py set TRITON_INTERPRET=1 before anything imported it

from attention_cases import check_against_reference, make_case, random_rows, run_backend  # noqa: E402

from llmserve.model import split_keys, triton_kernels  # noqa: E402
from llmserve.model.attn_torch import TorchAttentionBackend  # noqa: E402
from llmserve.model.attn_triton import TritonAttentionBackend  # noqa: E402
from llmserve.model.paged_indices import query_tiles  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MIXED_ROWS = [(40, 1), (0, 70), (7, 3), (0, 5), (100, 30), (299, 1), (0, 1), (33, 16), (5, 17), (15, 1)]


def on_device(case):
    q, k, v, kv_cache, inputs, full = case
    inputs.query_start_loc, inputs.seq_lens = inputs.query_start_loc.to(DEVICE), inputs.seq_lens.to(DEVICE)
    inputs.block_table, inputs.slot_mapping = inputs.block_table.to(DEVICE), inputs.slot_mapping.to(DEVICE)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv_cache.to(DEVICE), inputs, full


def test_query_tiles():
    tile_rows, tile_starts = query_tiles([1, 5, 1, 4], block_q=4)
    assert tile_rows.tolist() == [0, 1, 1, 2, 3]
    assert tile_starts.tolist() == [0, 0, 4, 0, 0]
    assert tile_rows.dtype == np.int32 and tile_starts.dtype == np.int32


def test_block_q():
    assert triton_kernels.block_q_for(1) == 1
    assert triton_kernels.block_q_for(5) == 16


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seed", range(2))
def test_decode_like_rows(block_size, group, seed):
    case = on_device(make_case(random_rows(seed), block_size, group, seed, num_blocks=1024))
    q, k, v, kv_cache, inputs, full = case
    out, metadata = run_backend(TritonAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.tile_rows.numel() == len(full)  # every row here fits one tile
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_rows_with_their_keys_split(num_splits, group, monkeypatch):
    """Flash decoding: each row's keys in num_splits parts (some of them empty for short rows), merged."""
    rows = [(40, 1), (0, 1), (299, 1), (17, 1), (130, 1)]
    q, k, v, kv_cache, inputs, full = on_device(make_case(rows, 16, group, seed=num_splits, num_blocks=256))
    monkeypatch.setattr(triton_kernels, "num_splits_for", lambda *args: num_splits)
    backend = TritonAttentionBackend()
    metadata = dataclasses.replace(backend.build_metadata(inputs), split_keys=True)
    out = backend.forward(q, k, v, kv_cache.clone(), metadata, q.shape[-1] ** -0.5)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)


@pytest.mark.parametrize("rows,splits", [([(1100, 1), (3, 1)], True), ([(900, 1), (3, 1)], False),
                                         ([(1100, 2), (3, 1)], False)])
def test_only_decode_steps_with_a_long_row_split_their_keys(rows, splits):
    """SPLIT_MIN_KEYS (1,024 keys) in the step's longest row, and every row one query."""
    inputs = make_case(rows, 16, 1, seed=1, num_blocks=128)[4]
    assert TritonAttentionBackend().build_metadata(inputs).split_keys == splits


def test_split_counts_follow_the_steps_shape():
    assert split_keys.num_splits_for(1, 8, 1) == 16  # one row of 8 kv heads: 8 programs -> 128
    assert split_keys.num_splits_for(16, 8, 1) == 4
    assert split_keys.num_splits_for(3, 8, 1) == 16 and split_keys.num_splits_for(12, 8, 1) == 8
    assert split_keys.num_splits_for(64, 8, 1) == 1
    assert split_keys.num_splits_for(1, 8, 16) == 1  # tiles of 16 queries (prompts, chunks) never split


@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_prefill_prefix_and_decode_rows(block_size):
    q, k, v, kv_cache, inputs, full = on_device(make_case(MIXED_ROWS, block_size, 3, seed=11, num_blocks=512))
    out, metadata = run_backend(TritonAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.block_q == 16 and metadata.tile_rows.tolist().count(1) == 5  # 70 queries: 5 tiles
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)
    torch_out, _ = run_backend(TorchAttentionBackend(use_cpu_kernel=False), q.cpu(), k.cpu(), v.cpu(),
                               kv_cache.cpu(), make_case(MIXED_ROWS, block_size, 3, seed=11, num_blocks=512)[4])
    torch.testing.assert_close(out.cpu(), torch_out, atol=1e-5, rtol=1e-5)


def test_head_dim_not_a_power_of_two():
    rows = [(20, 1), (0, 9), (17, 4)]
    q, k, v, kv_cache, inputs, full = on_device(make_case(rows, 16, 3, seed=2, head_dim=80, num_blocks=64))
    out, _ = run_backend(TritonAttentionBackend(), q, k, v, kv_cache, inputs)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("Triton's interpreter multiplies bf16 in tl.dot wrongly (numpy has no bf16); runs on CUDA")
    q, k, v, kv_cache, inputs, full = on_device(make_case(MIXED_ROWS, 16, 3, seed=4, dtype=dtype, num_blocks=512))
    out, _ = run_backend(TritonAttentionBackend(), q, k, v, kv_cache, inputs)
    assert out.dtype == dtype
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=2e-2)


def test_writes_the_step_kv_and_only_its_rows():
    rows = [(10, 1), (50, 4), (3, 1)]
    q, k, v, kv_cache, inputs, full = on_device(make_case(rows, 16, 3, seed=5, num_blocks=64))
    backend = TritonAttentionBackend()
    metadata = backend.build_metadata(inputs)
    backend.forward(q, k, v, kv_cache, metadata, q.shape[-1] ** -0.5)  # writes this step's k/v
    assert torch.equal(kv_cache[0].view(-1, *k.shape[1:])[inputs.slot_mapping], k)
    out = torch.full(q.shape, 7.0, device=DEVICE)
    one_tile = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    triton_kernels.paged_attention(out, q.contiguous(), kv_cache, metadata.block_table, metadata.seq_lens,
                                   metadata.query_start_loc, one_tile, torch.zeros_like(one_tile), metadata.block_q,
                                   q.shape[-1] ** -0.5)
    assert bool((out[:1] == 7.0).all()) and bool((out[5:] == 7.0).all())
    check_against_reference(out[1:5], q[1:5], [0, 4], full[1:2], atol=1e-5)


def test_graph_metadata_with_padded_rows():
    """A decode batch padded like a CUDA-graph bucket: pad rows read and write only the null block."""
    rows = [(10, 1), (40, 1), (3, 1)]
    q, k, v, kv_cache, inputs, full = on_device(make_case(rows, 16, 3, seed=8, num_blocks=64))
    num_padded = 8
    pad = num_padded - len(rows)
    int32 = dict(dtype=torch.int32, device=DEVICE)
    block_table = torch.zeros(num_padded, 8, **int32)
    block_table[:len(rows), :inputs.block_table.shape[1]] = inputs.block_table
    seq_lens = torch.cat([inputs.seq_lens, torch.ones(pad, **int32)])
    slot_mapping = torch.cat([inputs.slot_mapping, torch.zeros(pad, dtype=torch.int64, device=DEVICE)])
    backend = TritonAttentionBackend()
    metadata = backend.graph_metadata(slot_mapping, block_table, seq_lens, torch.arange(num_padded + 1, **int32),
                                      torch.arange(num_padded, **int32), torch.zeros(num_padded, **int32))
    pad_q = lambda t: torch.cat([t, torch.randn(pad, *t.shape[1:], device=DEVICE)])  # noqa: E731
    out = backend.forward(pad_q(q), pad_q(k), pad_q(v), kv_cache, metadata, q.shape[-1] ** -0.5)
    check_against_reference(out[:len(rows)], q, inputs.query_start_loc.tolist(), full, atol=1e-5)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (3, 80)])
def test_kv_write_kernel_stores_strided_rows_where_index_copy_does(dtype, num_kv_heads, head_dim):
    """k and v as views of one qkv projection's rows (as Attention passes them), written at scattered slots of a
    [2, N, bs, Hkv, D] cache: the same cache index_copy_ leaves, nothing else touched."""
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_q_heads = 7, 2 * num_kv_heads
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, num_q_heads:num_q_heads + num_kv_heads], qkv[:, num_q_heads + num_kv_heads:]
    cache = torch.randn(2, 6, 4, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(24, generator=gen)[:num_tokens].to(DEVICE)
    want = cache.clone()
    want[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    want[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
    assert triton_kernels.can_write_kv(cache, k, v)
    triton_kernels.write_kv(cache, slots, k, v)
    assert torch.equal(cache, want)
    assert not triton_kernels.can_write_kv(cache.to(torch.int8), k, v)  # a quantized cache takes write_kv
