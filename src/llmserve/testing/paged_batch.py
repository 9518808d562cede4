"""A tiny paged-KV bookkeeper for tests and micro-benchmarks: it turns "these requests get these new
tokens this step" into input_ids, positions and AttentionInputs, handing out blocks in a shuffled
(non-contiguous) order. The real scheduler and model runner do this for the engine.
"""

from __future__ import annotations

import random

import torch

from llmserve.model.attention import AttentionInputs


class PagedBatchBuilder:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        free = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(free)
        self.free_blocks = free
        self.block_size = block_size
        self.block_ids: dict[object, list[int]] = {}
        self.num_tokens: dict[object, int] = {}

    def _allocate(self, req_id: object, num_new: int) -> None:
        blocks = self.block_ids.setdefault(req_id, [])
        total = self.num_tokens.get(req_id, 0) + num_new
        while len(blocks) * self.block_size < total:
            if not self.free_blocks:
                raise ValueError("out of KV blocks")
            blocks.append(self.free_blocks.pop())

    def add_cached(self, req_id: object, num_tokens: int) -> list[int]:
        """Pretend num_tokens more tokens of a request are already in the cache -> their slots."""
        self._allocate(req_id, num_tokens)
        start = self.num_tokens.get(req_id, 0)
        self.num_tokens[req_id] = start + num_tokens
        return [self._slot(req_id, pos) for pos in range(start, start + num_tokens)]

    def _slot(self, req_id: object, pos: int) -> int:
        return self.block_ids[req_id][pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, rows: list[tuple[object, list[int]]], device: torch.device | str = "cpu"):
        """rows: (request id, new token ids) in row order -> (input_ids [T], positions [T], AttentionInputs)."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for req_id, tokens in rows:
            self._allocate(req_id, len(tokens))
            start = self.num_tokens.get(req_id, 0)
            for pos in range(start, start + len(tokens)):
                positions.append(pos)
                slots.append(self._slot(req_id, pos))
            input_ids += tokens
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            self.num_tokens[req_id] = start + len(tokens)
        inputs = self._inputs([r for r, _ in rows], query_lens, seq_lens, slots, device)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return as_long(input_ids), as_long(positions), inputs

    def _inputs(self, req_ids: list, query_lens: list[int], seq_lens: list[int], slots: list[int],
                device) -> AttentionInputs:
        width = max(len(self.block_ids[r]) for r in req_ids)
        table = [self.block_ids[r] + [0] * (width - len(self.block_ids[r])) for r in req_ids]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return AttentionInputs(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=torch.tensor(table, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, block_size=self.block_size)


def allocate_kv_caches(model, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """One zeroed cache per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = model.kv_cache_shape(num_blocks, block_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
