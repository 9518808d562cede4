"""The Triton kernel of Multi-head Latent Attention (model/mla_triton.py) against the float64 reference that expands
K and V per head: a step mixing fresh prompts, continued prefixes and decode rows (tiles of 16 queries of one
head), decode-only steps (one query of 16 heads a program, more heads than a program takes), and the decode
graphs' metadata over persistent buffers; a float16 and an fp8 latent cache. On CUDA it runs compiled; elsewhere
through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without CUDA, conftest.py set TRITON_INTERPRET=1 before anything imported it

from mla_cases import KV_LORA, ROPE, make_step  # noqa: E402

from llmserve.model import mla_triton  # noqa: E402
from llmserve.model.attention import FP8_KV_DTYPE  # noqa: E402
from llmserve.model.attn_triton import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DECODE_ROWS = [(9, 1), (0, 1), (13, 1), (30, 1), (100, 1), (70, 1)]


def _run(step, dtype, metadata=None, cache_dtype=None) -> torch.Tensor:
    backend = TritonAttentionBackend()
    attention, cache = step.attention.to(dtype), step.cache.to(cache_dtype or dtype)
    with torch.no_grad():
        metadata = metadata or backend.build_metadata(step.inputs)
        out = attention(step.new_x.to(dtype), tuple(t.to(dtype) for t in step.cos_sin), cache, metadata, backend)
    assert cache.view(-1, KV_LORA + ROPE)[step.inputs.slot_mapping].float().abs().sum() > 0  # the new entries, stored
    return out.double().cpu()


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_fresh_continuing_and_decode_rows_equal_per_head_attention(q_lora_rank):
    step = make_step(q_lora_rank, device=DEVICE)
    torch.testing.assert_close(_run(step, torch.float32), step.expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads", [4, 20])
def test_decode_rows_take_one_query_of_many_heads_a_program(num_heads):
    step = make_step(12, DECODE_ROWS, num_heads=num_heads, device=DEVICE)
    metadata = TritonAttentionBackend().build_metadata(step.inputs)
    assert metadata.block_q == 1
    torch.testing.assert_close(_run(step, torch.float32, metadata), step.expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 16])
def test_decode_rows_split_over_their_entries_and_merged(num_splits, monkeypatch):
    """Flash decoding: each row's entries in num_splits parts (of whole 32-entry blocks: a 101-entry row fills 4
    of 16, a 1-entry row 1), each part's softmax apart, then merged."""
    monkeypatch.setattr(mla_triton, "num_splits_for", lambda *args: num_splits)
    step = make_step(None, DECODE_ROWS, num_heads=20, device=DEVICE)
    torch.testing.assert_close(_run(step, torch.float32), step.expected, rtol=1e-5, atol=1e-5)


def test_decode_graph_metadata_over_persistent_buffers():
    """The graphs' metadata: one tile per row, the tile arrays fixed buffers (model/attn_triton.graph_metadata)."""
    step = make_step(None, DECODE_ROWS, device=DEVICE)
    inputs, num_rows = step.inputs, len(DECODE_ROWS)
    int32 = dict(dtype=torch.int32, device=DEVICE)
    metadata = TritonAttentionBackend().graph_metadata(
        inputs.slot_mapping, inputs.block_table, inputs.seq_lens, inputs.query_start_loc,
        torch.arange(num_rows, **int32), torch.zeros(num_rows, **int32))
    torch.testing.assert_close(_run(step, torch.float32, metadata), step.expected, rtol=1e-5, atol=1e-5)


def test_half_precision_rows():
    step = make_step(12, device=DEVICE)
    torch.testing.assert_close(_run(step, torch.float16), step.expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("cache_dtype", "tolerance"), [(torch.float16, 2e-3), (FP8_KV_DTYPE, 3e-2)])
def test_a_float16_or_fp8_latent_cache(cache_dtype, tolerance):
    step = make_step(12, device=DEVICE, cache_dtype=cache_dtype)
    out = _run(step, torch.float32, cache_dtype=cache_dtype)
    torch.testing.assert_close(out, step.expected, rtol=tolerance, atol=tolerance)


def test_splits_only_where_a_decode_step_has_few_programs():
    assert mla_triton.num_splits_for(1, 8, 1) == 16  # V3's 128 heads, one row: 8 programs -> 128
    assert mla_triton.num_splits_for(16, 8, 1) == 4
    assert mla_triton.num_splits_for(64, 8, 1) == 1
    assert mla_triton.num_splits_for(1, 8, 16) == 1  # tiles of 16 queries (prompts, chunks) never split
