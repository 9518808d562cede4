"""--kv-cache-dtype fp8: both attention backends read an e4m3 cache; against the float64 reference over
the fp8-rounded K/V (tight) and over the exact K/V (within FP8 tolerance)."""

from __future__ import annotations

import pytest
import torch

from attention_cases import check_against_reference, make_case, random_rows, run_backend

from llmserve.model.attention import FP8_KV_DTYPE, write_kv
from llmserve.model.attn_torch import TorchAttentionBackend

MIXED_ROWS = [(40, 1), (0, 30), (7, 3), (0, 5), (60, 20), (99, 1), (0, 1), (33, 16)]


def _fp8_case(rows, seed: int, block_size: int = 16):
    """The case with its cache stored as fp8, and each row's full K/V rounded the way the cache holds it."""
    q, k, v, kv_cache, inputs, full = make_case(rows, block_size, 3, seed, num_blocks=256)
    rounded = [(fk.to(FP8_KV_DTYPE).float(), fv.to(FP8_KV_DTYPE).float()) for fk, fv in full]
    return q, k, v, kv_cache.to(FP8_KV_DTYPE), inputs, full, rounded


def _backends():
    yield TorchAttentionBackend(use_cpu_kernel=False)
    yield TorchAttentionBackend()  # the C++ kernel does not read fp8: its rows fall back to torch
    if pytest.importorskip("triton"):
        from llmserve.model.attn_triton import TritonAttentionBackend

        yield TritonAttentionBackend()


@pytest.mark.parametrize("backend_index", [0, 1, 2])
@pytest.mark.parametrize("rows", ["mixed", "decode"])
def test_fp8_cache_against_reference(backend_index, rows):
    backend = list(_backends())[backend_index]
    case_rows = MIXED_ROWS if rows == "mixed" else random_rows(3)[:12]
    q, k, v, kv_cache, inputs, full, rounded = _fp8_case(case_rows, seed=7)
    out, _ = run_backend(backend, q, k, v, kv_cache, inputs)
    starts = inputs.query_start_loc.tolist()
    check_against_reference(out, q, starts, rounded, atol=1e-4)  # exact up to float32 arithmetic
    check_against_reference(out, q, starts, full, atol=0.1)  # e4m3 keeps 3 mantissa bits: ~6% per element


def test_write_kv_saturates_to_e4m3_range():
    cache = torch.zeros(2, 4, 2, 1, 4, dtype=FP8_KV_DTYPE)
    k = torch.tensor([[[1000.0, -1000.0, 0.5, 3.0]]])
    write_kv(cache, torch.tensor([3]), k, -k)
    assert cache[0, 1, 1, 0].float().tolist() == [448.0, -448.0, 0.5, 3.0]
    assert cache[1, 1, 1, 0].float().tolist() == [-448.0, 448.0, -0.5, -3.0]
