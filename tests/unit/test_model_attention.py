"""TorchAttentionBackend against a naive per-request reference, over every grouping it uses."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.model.attention import select_attention_backend
from llmserve.model.attn_torch import TorchAttentionBackend
from llmserve.testing.paged_batch import PagedBatchBuilder

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 9, 3, 16, 8, 2048
SCALE = HEAD_DIM ** -0.5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One request: q [Q, H, D], its whole k/v [S, Hkv, D] (cached then new) -> [Q, H, D]."""
    num_q, num_s = q.shape[0], k.shape[0]
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * SCALE
    is_visible = torch.arange(num_s)[None, :] <= torch.arange(num_q)[:, None] + num_s - num_q
    probs = scores.masked_fill(~is_visible, float("-inf")).softmax(-1)
    return torch.einsum("hqs,shd->qhd", probs, v)


def run_case(rows: list[tuple[int, int]], seed: int) -> None:
    """rows: (cached tokens, new tokens) per request, in row order."""
    gen = torch.Generator().manual_seed(seed)
    builder = PagedBatchBuilder(NUM_BLOCKS, BLOCK_SIZE, seed=seed)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    history = {}
    for req, (num_cached, _) in enumerate(rows):
        slots = torch.tensor(builder.add_cached(req, num_cached), dtype=torch.int64)
        history[req] = [kv_cache[i].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].clone() for i in range(2)]
    _, _, inputs = builder.step([(req, [0] * n) for req, (_, n) in enumerate(rows)])
    num_tokens = sum(n for _, n in rows)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    backend = TorchAttentionBackend()
    out = backend.forward(q, k, v, kv_cache, backend.build_metadata(inputs), SCALE)
    starts = inputs.query_start_loc.tolist()
    for req in range(len(rows)):
        a, b = starts[req], starts[req + 1]
        full_k = torch.cat([history[req][0], k[a:b]])
        full_v = torch.cat([history[req][1], v[a:b]])
        torch.testing.assert_close(out[a:b], reference(q[a:b], full_k, full_v), atol=1e-5, rtol=1e-5)
    kc = kv_cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(kc[inputs.slot_mapping], k)


def random_rows(seed: int, num_decode: int, num_fresh: int, num_continuing: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    rows = [(rng.randint(0, 300), 1) for _ in range(num_decode)]
    rows += [(0, rng.randint(2, 40)) for _ in range(num_fresh)]
    rows += [(rng.randint(1, 200), rng.randint(2, 40)) for _ in range(num_continuing)]
    rng.shuffle(rows)
    return rows


@pytest.mark.parametrize("rows", [
    [(0, 1)],  # a one-token prompt
    [(5, 1), (17, 1), (0, 1), (31, 1)],  # decode only, one bucket, token order
    [(0, 12)],  # one fresh prompt: plain causal
    [(20, 7)],  # one continuing chunk
    [(0, 5), (0, 9), (0, 2)],  # several fresh prompts, padded
    [(0, 6), (0, 6)],  # fresh prompts of one length: plain causal, batched
    [(3, 1), (0, 6), (10, 1), (9, 4)],  # everything mixed
    [(i * 7, 1) for i in range(40)],  # decode spread over lengths: several buckets
])
def test_backend_matches_reference(rows):
    run_case(rows, seed=len(rows))


@pytest.mark.parametrize("seed", range(6))
def test_backend_matches_reference_on_random_batches(seed):
    rng = random.Random(seed)
    run_case(random_rows(seed, rng.randint(0, 40), rng.randint(0, 7), rng.randint(0, 7)) or [(0, 3)], seed)


def test_select_attention_backend_is_torch_on_cpu():
    assert isinstance(select_attention_backend(torch.device("cpu")), TorchAttentionBackend)


def test_select_attention_backend_by_name():
    pytest.importorskip("triton")
    from llmserve.model.attn_triton import TritonAttentionBackend

    assert isinstance(select_attention_backend(torch.device("cpu"), "triton"), TritonAttentionBackend)
    assert isinstance(select_attention_backend(torch.device("cpu"), "torch"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend(torch.device("cpu"), "flash")
