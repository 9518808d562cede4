"""The GPU attention backend: one Triton kernel (model.triton_kernels) for every row of a step.

`build_metadata` cuts each row's new tokens into query tiles on the host (numpy, once per step for
all layers) and copies the two small tile arrays to the device; `forward` writes the step's K/V into
the paged cache at the slot mapping (one Triton launch for both, unless the cache is quantized) and
launches the kernel once per layer on q as it comes (a strided view of the qkv projection: no copy).

For CUDA graphs, `graph_metadata` wraps persistent buffers instead: a batch of B rows of the same few
queries (decode: one; verification: 1 + k) has one tile per row (tile_rows = 0..B-1, tile_starts = 0),
so only the buffers' contents change between replays, never their addresses or the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.model import split_keys, triton_kernels
from llmserve.model.attention import K_SCALE, V_SCALE, AttentionBackend, AttentionInputs, as_int32, write_kv
from llmserve.model.paged_indices import query_tiles


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    tile_rows: torch.Tensor  # [tiles] int32: the row of each query tile
    tile_starts: torch.Tensor  # [tiles] int32: its first query, counted within the row
    block_q: int  # query tokens per tile
    split_keys: bool = False  # a decode step may split its rows' keys (flash decoding: model/triton_splits.py)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through one Triton kernel launch per layer (CUDA; any device under TRITON_INTERPRET)."""

    name = "triton"

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        device = inputs.block_table.device
        block_q = triton_kernels.block_q_for(max(inputs.query_lens_cpu))
        tile_rows, tile_starts = query_tiles(inputs.query_lens_cpu, block_q)
        return TritonAttentionMetadata(
            slot_mapping=inputs.slot_mapping.long(), block_table=as_int32(inputs.block_table),
            seq_lens=as_int32(inputs.seq_lens), query_start_loc=as_int32(inputs.query_start_loc),
            tile_rows=torch.from_numpy(tile_rows).to(device, non_blocking=True),
            tile_starts=torch.from_numpy(tile_starts).to(device, non_blocking=True), block_q=block_q,
            split_keys=split_keys.is_long_decode(max(inputs.query_lens_cpu), inputs.seq_lens_cpu))

    def graph_metadata(self, slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, tile_rows: torch.Tensor, tile_starts: torch.Tensor,
                       queries_per_row: int = 1, split_keys: bool = False) -> TritonAttentionMetadata:
        """Metadata over persistent buffers (every row `queries_per_row` queries, one tile) for CUDA graphs.
        split_keys: a graph whose decode attention splits rows' keys (long rows, few programs)."""
        block_q = triton_kernels.block_q_for(queries_per_row)
        assert queries_per_row <= block_q, "a captured row's queries must fit one tile"
        return TritonAttentionMetadata(slot_mapping, block_table, seq_lens, query_start_loc, tile_rows,
                                       tile_starts, block_q, split_keys)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonAttentionMetadata, scale: float, window: int = 0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache [2, N, bs, Hkv, D], sinks [H] or None -> out [T, H, D]."""
        if triton_kernels.can_write_kv(kv_cache, k, v):
            triton_kernels.write_kv(kv_cache, metadata.slot_mapping, k, v)
        else:  # a quantized cache
            write_kv(kv_cache, metadata.slot_mapping, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view: the kernel takes it
        triton_kernels.paged_attention(out, q, kv_cache, metadata.block_table, metadata.seq_lens,
                                       metadata.query_start_loc, metadata.tile_rows, metadata.tile_starts,
                                       metadata.block_q, scale, K_SCALE, V_SCALE, window, sinks,
                                       metadata.split_keys)
        return out
