"""Shared by the attention backend tests: paged batches with random block tables, and a float64 reference."""

from __future__ import annotations

import random

import torch

from llmserve.testing.paged_batch import PagedBatchBuilder

HEAD_DIM, NUM_KV_HEADS, NUM_BLOCKS = 64, 2, 4096
SCALE = HEAD_DIM ** -0.5


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One request: q [Q, H, D], its whole k/v [S, Hkv, D] -> [Q, H, D], in float64. window > 0: a query at
    position p sees keys p - window + 1 .. p; sinks [H]: one more logit per head in the softmax, no value."""
    q, k, v = q.double(), k.double(), v.double()
    num_q, num_s, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * q.shape[-1] ** -0.5
    q_pos, k_pos = torch.arange(num_q)[:, None] + num_s - num_q, torch.arange(num_s)[None, :]  # [Q, 1], [1, S]
    is_visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window > 0 else True)
    scores = scores.masked_fill(~is_visible, float("-inf"))  # [H, Q, S]
    if sinks is not None:
        sink = sinks.double().cpu().view(-1, 1, 1).expand(-1, num_q, 1)  # [H, Q, 1]
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqs,shd->qhd", probs, v)


def make_case(rows: list[tuple[int, int]], block_size: int, group: int, seed: int, dtype=torch.float32,
              head_dim: int = HEAD_DIM, num_blocks: int = NUM_BLOCKS):
    """rows: (cached tokens, new tokens) -> (q, k, v, kv_cache, inputs, per-row full k/v)."""
    gen = torch.Generator().manual_seed(seed)
    builder = PagedBatchBuilder(num_blocks, block_size, seed=seed)
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    history = {}
    for req, (num_cached, _) in enumerate(rows):
        slots = torch.tensor(builder.add_cached(req, num_cached), dtype=torch.int64)
        history[req] = [kv_cache[i].view(-1, NUM_KV_HEADS, head_dim)[slots].clone() for i in range(2)]
    _, _, inputs = builder.step([(req, [0] * n) for req, (_, n) in enumerate(rows)])
    num_tokens = sum(n for _, n in rows)
    # q as a view into a fused qkv output, like the model's (non-contiguous rows)
    qkv = torch.randn(num_tokens, (group + 2) * NUM_KV_HEADS * head_dim, generator=gen).to(dtype)
    q = qkv[:, :group * NUM_KV_HEADS * head_dim].view(num_tokens, group * NUM_KV_HEADS, head_dim)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype) for _ in range(2))
    starts = inputs.query_start_loc.tolist()
    full = [(torch.cat([history[r][0], k[starts[r]:starts[r + 1]]]), torch.cat([history[r][1], v[starts[r]:starts[r + 1]]]))
            for r in range(len(rows))]
    return q, k, v, kv_cache, inputs, full


def run_backend(backend, q, k, v, kv_cache, inputs, **layer):
    """layer: the per-layer arguments of forward (window, sinks)."""
    metadata = backend.build_metadata(inputs)
    return backend.forward(q, k, v, kv_cache.clone(), metadata, q.shape[-1] ** -0.5, **layer), metadata


def random_rows(seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    rows = [(rng.randint(0, 299), 1) for _ in range(rng.randint(5, 30))]  # decode: seq_len 1..300
    rows += [(rng.randint(1, 280), rng.randint(2, 16)) for _ in range(rng.randint(2, 6))]  # verification rows
    rows += [(0, 1)]  # a one-token prompt
    rng.shuffle(rows)
    return rows


def check_against_reference(out: torch.Tensor, q: torch.Tensor, starts: list[int], full, atol: float,
                            **layer) -> None:
    """Each row's out [Q, H, D] against the float64 reference over its whole k/v (compared in float64)."""
    for r, (full_k, full_v) in enumerate(full):
        expected = reference(q[starts[r]:starts[r + 1]].cpu(), full_k.cpu(), full_v.cpu(), **layer)
        torch.testing.assert_close(out[starts[r]:starts[r + 1]].cpu().double(), expected, atol=atol, rtol=atol)
