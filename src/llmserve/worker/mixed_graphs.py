"""CUDA graphs of mixed steps: prompt chunks beside decode rows, or prompts alone, of up to a few hundred
tokens, captured per padded token count (32, 64, ... 512, then every 64). Eagerly such a step launches every
kernel of every layer from Python, several times a decode replay's time (docs/benchmarks.md, H200 eighth run);
replayed, its launches cost what a decode step's do.

The attention kernel is inside the graph. Its grid, the step's number of query tiles, depends on the rows'
mix, so a graph fixes it at the most a step of its token count can have: ceil(T / 16) for the tokens plus one
for each row that ends a tile early (at most min(rows, T) of them, the padding row included). The step's rows
come first, then a padding row that takes the padded tokens (positions 0.., slots in the null block, causal
over keys it writes itself), then an empty row (no queries, no keys): the tiles past the step's point at it,
and their programs store nothing.

A step runs here when it has no FP8 token kinds (those layers pick kernels per token kind on the host), at most
max_rows rows and the largest size's tokens, and the decode or verification graphs cannot take it (they come
first): prompts, prompt chunks beside decode or verification rows (drafts are queries like any other), and
verification steps past the verification graphs' batch.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.model.lora_layers import LoRAContext
from llmserve.model.paged_indices import on_device, query_tiles
from llmserve.worker.cuda_graphs import StepGraphs
from llmserve.worker.step_inputs import StepInputs

PROMPT_TILE = 16  # queries a tile of the Triton kernel when any row has more than one (triton_kernels.block_q_for)
TOKEN_STEP = 32  # sizes are multiples of this up to 512 tokens, then of 64 (at most 1/16 of a step padding)


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """32, 64, ... 512, 576, 640, ... up to max_tokens (max_tokens itself last when it falls between)."""
    sizes = list(range(TOKEN_STEP, min(max_tokens, 512) + 1, TOKEN_STEP))
    sizes += list(range(512 + 2 * TOKEN_STEP, max_tokens + 1, 2 * TOKEN_STEP))
    return sizes if sizes and sizes[-1] == max_tokens else sizes + [max_tokens]


def max_tiles(num_tokens: int, max_rows: int) -> int:
    """The most query tiles a step of num_tokens tokens in at most max_rows rows (and the padding row) cuts:
    each row adds at most one partial tile to ceil(num_tokens / 16)."""
    return -(-num_tokens // PROMPT_TILE) + min(max_rows, num_tokens) + 1


class MixedGraphs(StepGraphs):
    def __init__(self, model: torch.nn.Module, backend, kv_caches: list[torch.Tensor], max_tokens: int,
                 max_rows: int, max_blocks: int, block_size: int, device: torch.device, use_graphs: bool = True,
                 layer_groups: tuple[int, ...] | None = None, lora: LoRAContext | None = None) -> None:
        """max_tokens: the largest step captured; max_rows: its most rows (requests); max_blocks: block-table
        columns; block_size: tokens a KV block (the padding row's slots stay in the null block)."""
        sizes = mixed_graph_sizes(max_tokens)
        self.max_rows = min(max_rows, sizes[-1])
        num_rows = self.max_rows + 2  # the step's, the padding row, the empty row
        super().__init__(model, backend, kv_caches, sizes, sizes[-1], num_rows, max_tiles(sizes[-1], self.max_rows),
                         max_blocks, device, use_graphs, layer_groups, lora)
        self.empty_row = num_rows - 1
        self.pad_positions = torch.arange(sizes[-1], dtype=torch.int64, device=device)  # [T]
        self.pad_slots = self.pad_positions % block_size  # [T] slots of the null block (block 0)
        self.num_tiles = {size: max_tiles(size, self.max_rows) for size in sizes}

    def num_tokens_of(self, size: int) -> int:
        return size

    def _metadata(self, size: int, split_keys: bool):
        tiles = slice(0, self.num_tiles[size])
        groups = [self.backend.graph_metadata(slots[:size], table, self.seq_lens, self.query_start_loc,
                                              self.tile_rows[tiles], self.tile_starts[tiles], PROMPT_TILE)
                  for slots, table in zip(self.slot_mappings, self.block_tables)]
        return groups[0] if self.layer_groups is None else [groups[g] for g in self.layer_groups]

    def describe(self) -> str:
        return f"mixed steps of {self.sizes[0]}..{self.sizes[-1]} tokens in {len(self.sizes)} sizes"

    def can_run(self, inputs: StepInputs, has_drafts: bool) -> bool:
        """No FP8 token kinds, as many KV cache groups as captured, and a captured size's fit (drafts or not)."""
        attn = inputs.attn
        return (inputs.token_kinds is None
                and (inputs.attn_groups is None) == (self.layer_groups is None)
                and inputs.input_ids.shape[0] <= self.sizes[-1] and len(attn.query_lens_cpu) <= self.max_rows
                and attn.block_table.shape[1] <= self.max_blocks)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """A step's hidden states [T, hidden] through the smallest captured size >= T (a view of the graph's
        output: read it before the next run)."""
        groups = inputs.attn_groups or [inputs.attn]
        num_tokens = inputs.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_tokens)
        self._copy_tokens(inputs.input_ids, inputs.positions, [a.slot_mapping for a in groups], num_tokens)
        num_rows = self._copy_block_tables([a.block_table for a in groups])
        self._pad(num_tokens, num_rows, size)
        self.row_meta.copy_(on_device(self._row_meta(inputs.attn.query_lens_cpu, inputs.attn.seq_lens_cpu, size),
                                      self.row_meta.device), non_blocking=True)
        return self._replay((size, False), num_tokens)

    def _pad(self, num_tokens: int, num_rows: int, size: int) -> None:
        """Tokens num_tokens..size-1 to the padding row: token 0 at positions 0.., slots in the null block,
        whose table row is all null block."""
        num_pad = size - num_tokens
        self.input_ids[num_tokens:size].zero_()
        self.positions[num_tokens:size].copy_(self.pad_positions[:num_pad])
        self.slot_mappings[:, num_tokens:size].copy_(self.pad_slots[:num_pad].expand(len(self.slot_mappings), -1))
        self.block_tables[:, num_rows].zero_()

    def _row_meta(self, query_lens: list[int], seq_lens: list[int], size: int) -> np.ndarray:
        """The row_meta buffer's host copy: seq_lens [R], query_start_loc [R + 1], tile_rows and tile_starts
        [tiles] for the step's rows, the padding row and empty rows after them."""
        num_rows, max_rows = len(query_lens), len(self.seq_lens)
        num_pad = size - sum(query_lens)
        lens = np.zeros(max_rows, np.int32)  # [R] query lens: the step's, the padding row's, then empty rows
        lens[:num_rows], lens[num_rows] = query_lens, num_pad
        keys = lens.copy()  # [R] seq lens: the padding row sees its own tokens only
        keys[:num_rows] = seq_lens
        starts = np.zeros(max_rows + 1, np.int32)  # [R + 1]
        np.cumsum(lens, out=starts[1:])
        tile_rows, tile_starts = query_tiles(lens[:num_rows + 1], PROMPT_TILE)  # [k] each
        num_tiles = len(self.tile_rows)
        assert len(tile_rows) <= self.num_tiles[size], "a step cut into more tiles than its graph's grid"
        rows = np.full(num_tiles, self.empty_row, np.int32)  # [tiles] past the step's: the empty row
        rows[:len(tile_rows)] = tile_rows
        first = np.zeros(num_tiles, np.int32)  # [tiles]
        first[:len(tile_starts)] = tile_starts
        return np.concatenate([keys, starts, rows, first])
