"""CUDA graphs for decode steps: the model forward of a batch of one-token rows, captured once per
padded batch size at start-up and replayed each step; and, with speculative decoding, of verification
steps (`queries_per_row` = 1 + k: every row its last token and k drafts).

A step of B such rows (no prefill chunk) runs in the smallest captured size >= B. Its inputs are copied
into persistent buffers (the captured kernels read them at fixed addresses); the rows past B are
padding: token 0 at position 0, as many keys as queries, block table all null block, slot 0, so they
write only into the null block (never allocated) and read only from it. The logits are taken outside
the graph from the first B rows' hidden states.

With KV cache groups (core/kv_cache_groups.py) each group has its block table and slot buffers, and each
layer reads its group's metadata (`layer_groups`).

With LoRA adapters (`lora`, the wrapped projections' context) the graph holds a padded step too: every
token's slot in a buffer (-1: the base model's, padding included) that the Triton LoRA kernels read, filled
from the runner's step before each replay.

A target that keeps some layers' inputs for an EAGLE-3 head (model.aux_layers) keeps them in the graph's memory
too: after a replay the model's `aux_hidden` is set to views of the captured tensors, as the output is.

`use_graphs=False` keeps the same buffers and padding but calls the model eagerly: that path runs
on CPU (with the Triton backend under TRITON_INTERPRET) so the tests check the padding logic
without a GPU. `StepGraphs` is what these graphs share with those of mixed steps (worker/mixed_graphs.py).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from llmserve.model.lora_layers import LoRAContext, LoRAStep
from llmserve.model.quant.token_kinds import ALL_DECODE, step_kinds_of
from llmserve.model.split_keys import is_long_decode, num_splits_for
from llmserve.worker.step_inputs import StepInputs

if TYPE_CHECKING:  # triton is imported only where the Triton backend is used
    from llmserve.model.attn_triton import TritonAttentionBackend

logger = logging.getLogger(__name__)


def split_key_sizes(sizes: list[int], kv_caches: list[torch.Tensor]) -> list[int]:
    """The decode sizes whose attention would split rows' keys (few programs: model/triton_splits.py), for a model
    of K/V caches [2, N, bs, Hkv, D]; none for other caches (a latent cache's kernel splits by itself)."""
    if not kv_caches or any(c.dim() != 5 or c.shape[0] != 2 for c in kv_caches):
        return []
    min_kv_heads = min(c.shape[3] for c in kv_caches)
    return [size for size in sizes if num_splits_for(size, min_kv_heads, 1) > 1]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (vLLM-like buckets: <= 15 rows of padding)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    return sizes


class StepGraphs:
    """A forward captured per padded size over persistent input buffers: the buffers (tokens, rows, query
    tiles, KV cache groups, LoRA slots), the capture of every size into one memory pool, and the replay, or
    with use_graphs=False an eager call over the same buffers. Subclasses say what a size holds. A graph's key
    is (size, split_keys): decode sizes may have a second graph whose attention splits long rows' keys."""

    def __init__(self, model: torch.nn.Module, backend: TritonAttentionBackend, kv_caches: list[torch.Tensor],
                 sizes: list[int], max_tokens: int, max_rows: int, max_tiles: int, max_blocks: int,
                 device: torch.device, use_graphs: bool, layer_groups: tuple[int, ...] | None,
                 lora: LoRAContext | None) -> None:
        self.model, self.backend, self.kv_caches, self.lora = model, backend, kv_caches, lora
        self.layer_groups = layer_groups
        num_groups = 1 if layer_groups is None else max(layer_groups) + 1
        self.sizes, self.max_blocks, self.use_graphs = sizes, max_blocks, use_graphs
        self.keys: list[tuple[int, bool]] = [(size, False) for size in sizes]  # the graphs captured
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # [T]
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # [T]
        self.slot_mappings = torch.zeros(num_groups, max_tokens, dtype=torch.int64, device=device)  # [G, T]
        self.block_tables = torch.zeros(num_groups, max_rows, max_blocks, **int32)  # [G, R, W]
        self.slot_mapping, self.block_table = self.slot_mappings[0], self.block_tables[0]  # the first group's
        # the rows' and tiles' int32 metadata in one buffer (one copy a step where it changes)
        self.row_meta = torch.zeros(2 * max_rows + 1 + 2 * max_tiles, **int32)
        self.seq_lens = self.row_meta[:max_rows]  # [R]
        self.query_start_loc = self.row_meta[max_rows:2 * max_rows + 1]  # [R + 1]
        self.tile_rows = self.row_meta[2 * max_rows + 1:2 * max_rows + 1 + max_tiles]  # [tiles]
        self.tile_starts = self.row_meta[2 * max_rows + 1 + max_tiles:]  # [tiles]
        self.lora_tokens = torch.arange(max_tokens, dtype=torch.int64, device=device)  # [T]
        self.lora_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)  # [T] -1: base model
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[int, bool], torch.Tensor] = {}  # per key: the forward's output [tokens, hidden]
        # per key: the kept layer inputs {layer: [tokens, hidden]}
        self.aux: dict[tuple[int, bool], dict[int, torch.Tensor]] = {}

    def num_tokens_of(self, size: int) -> int:
        raise NotImplementedError

    def _metadata(self, size: int, split_keys: bool):
        """The backend's metadata over the buffers for a size; with groups [L] each layer's group's."""
        raise NotImplementedError

    def _step_kinds(self):
        """The context the forward runs in (FP8 layers' token kinds)."""
        return nullcontext()

    def _forward(self, key: tuple[int, bool]) -> torch.Tensor:
        with self._step_kinds():
            if self.lora is None:
                return self._model_forward(key)
            num_tokens = self.num_tokens_of(key[0])
            runner_step, self.lora.step = self.lora.step, LoRAStep(
                self.lora_tokens[:num_tokens], self.lora_slots[:num_tokens], [], is_padded=True)
            try:
                return self._model_forward(key)
            finally:
                self.lora.step = runner_step

    def _model_forward(self, key: tuple[int, bool]) -> torch.Tensor:
        num_tokens = self.num_tokens_of(key[0])
        return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens], self.kv_caches,
                          self._metadata(*key), self.backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every key, largest size first, into one memory pool (CUDA only)."""
        if not self.use_graphs:
            return
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for key in sorted(self.keys, reverse=True):
            self._forward(key)  # warm-up: compiles the kernels, settles lazy state
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[key] = self._forward(key)
            self.aux[key] = dict(getattr(self.model, "aux_hidden", {}))
            self.graphs[key] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of %s in %.1f s (%d MiB more reserved)", self.describe(),
                    time.perf_counter() - start, (torch.cuda.memory_reserved() - reserved) >> 20)

    def describe(self) -> str:
        raise NotImplementedError

    def _copy_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mappings: list[torch.Tensor],
                     num_tokens: int) -> None:
        """A step's tokens [num_tokens] (and each KV cache group's slots) into the buffers' first entries."""
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        for group, slots in enumerate(slot_mappings):
            self.slot_mappings[group, :num_tokens].copy_(slots, non_blocking=True)

    def _copy_block_tables(self, block_tables: list[torch.Tensor]) -> int:
        """Each group's [B, W] table into the first B rows (columns past W zeroed) -> B."""
        num_rows, width = block_tables[0].shape
        for group, table in enumerate(block_tables):
            self.block_tables[group, :num_rows, :width].copy_(table, non_blocking=True)
        self.block_tables[:, :num_rows, width:].zero_()
        return num_rows

    def _replay(self, key: tuple[int, bool], num_tokens: int) -> torch.Tensor:
        """The captured forward of `key` over the buffers -> hidden states [num_tokens, hidden] (a view of the
        graph's output: read it before the next run); the model's kept layer inputs likewise."""
        if self.lora is not None:
            self._copy_lora_slots()
        if not self.use_graphs:
            hidden, aux = self._forward(key), getattr(self.model, "aux_hidden", {})
        else:
            self.graphs[key].replay()
            hidden, aux = self.hidden[key], self.aux[key]
        if aux:
            self.model.aux_hidden = {layer: t[:num_tokens] for layer, t in aux.items()}
        return hidden[:num_tokens]

    def _copy_lora_slots(self) -> None:
        """The runner's step (adapter tokens only, or None: all base) as every token's slot, -1 elsewhere."""
        self.lora_slots.fill_(-1)
        step = self.lora.step
        if step is not None:
            self.lora_slots.index_copy_(0, step.token_indices, step.token_slots)


class DecodeGraphs(StepGraphs):
    def __init__(self, model: torch.nn.Module, backend: TritonAttentionBackend, kv_caches: list[torch.Tensor],
                 max_batch: int, max_blocks: int, device: torch.device, use_graphs: bool = True,
                 queries_per_row: int = 1, layer_groups: tuple[int, ...] | None = None,
                 lora: LoRAContext | None = None) -> None:
        """layer_groups: each layer's KV cache group (None: one group, one block table for every layer).
        lora: the context of the model's LoRA projections (None: no adapters)."""
        sizes = graph_batch_sizes(max_batch)
        n = sizes[-1]
        self.q = queries_per_row  # Q; at most one attention tile (16 queries)
        super().__init__(model, backend, kv_caches, sizes, n * self.q, n, n, max_blocks, device, use_graphs,
                         layer_groups, lora)
        self.step_kinds = step_kinds_of(model)
        self.split_sizes = split_key_sizes(sizes, kv_caches) if self.q == 1 else []
        self.keys += [(size, True) for size in self.split_sizes]
        self.seq_lens.fill_(self.q)  # [n]
        self.query_start_loc.copy_(torch.arange(n + 1, dtype=torch.int32) * self.q)  # [n + 1]: Q queries a row
        self.tile_rows.copy_(torch.arange(n, dtype=torch.int32))  # [n]: one tile per row
        self.tile_starts.zero_()  # [n]

    def num_tokens_of(self, size: int) -> int:
        return size * self.q

    def _metadata(self, size: int, split_keys: bool):
        groups = [self.backend.graph_metadata(slots[:size * self.q], table[:size], self.seq_lens[:size],
                                              self.query_start_loc[:size + 1], self.tile_rows[:size],
                                              self.tile_starts[:size], self.q, split_keys)
                  for slots, table in zip(self.slot_mappings, self.block_tables)]
        return groups[0] if self.layer_groups is None else [groups[g] for g in self.layer_groups]

    def _step_kinds(self):
        """Every token a decode token (FP8 layers: their decode kernel; model/quant/token_kinds.py)."""
        return nullcontext() if self.step_kinds is None else self.step_kinds.using(ALL_DECODE)

    def describe(self) -> str:
        split = f" (split keys up to {self.split_sizes[-1]})" if self.split_sizes else ""
        return f"decode batches {self.sizes}{split} of {self.q} quer{'y' if self.q == 1 else 'ies'} a row"

    def can_run(self, inputs: StepInputs, has_drafts: bool) -> bool:
        """Every row has Q queries (decode: one token, no drafts; verification: its token and Q - 1 drafts),
        all of them decode tokens when the step says (the FP8 layers were captured on their decode kernel), one
        as many KV cache groups as captured."""
        attn = inputs.attn
        if (inputs.attn_groups is None) != (self.layer_groups is None):
            return False
        num_rows = len(attn.query_lens_cpu)
        kinds = inputs.token_kinds
        return (has_drafts == (self.q > 1) and (kinds is None or kinds.is_all_decode)
                and inputs.input_ids.shape[0] == num_rows * self.q
                and max(attn.query_lens_cpu) == self.q and self.fits(num_rows, attn.block_table.shape[1]))

    def fits(self, num_rows: int, num_block_columns: int) -> bool:
        """Whether a decode batch of this many rows and block-table columns has a captured size."""
        return num_rows <= self.sizes[-1] and num_block_columns <= self.max_blocks

    def _padded_size(self, num_rows: int) -> int:
        return next(s for s in self.sizes if s >= num_rows)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """A step's hidden states [B * Q, hidden] through the smallest captured size >= B (its graph that splits
        the rows' keys when one is long: model/split_keys.py)."""
        groups = inputs.attn_groups or [inputs.attn]
        split_keys = bool(self.split_sizes) and is_long_decode(self.q, inputs.attn.seq_lens_cpu)
        return self.run_rows(inputs.input_ids, inputs.positions, [a.slot_mapping for a in groups],
                             inputs.attn.seq_lens, [a.block_table for a in groups], split_keys)

    @torch.inference_mode()
    def run_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor | list,
                 seq_lens: torch.Tensor, block_table: torch.Tensor | list, split_keys: bool = False) -> torch.Tensor:
        """input_ids, positions, slot_mapping [B * Q] int64, seq_lens [B] int32, block_table [B, W] int32,
        all on the device -> hidden states [B * Q, hidden] (a view of the graph's output: read it before the
        next run). With KV cache groups slot_mapping and block_table are lists, one a group. split_keys: the
        size's graph that splits long rows' keys, where it has one."""
        slot_mappings = slot_mapping if isinstance(slot_mapping, list) else [slot_mapping]
        block_tables = block_table if isinstance(block_table, list) else [block_table]
        num_rows = self._copy_block_tables(block_tables)
        size, num_tokens = self._padded_size(num_rows), num_rows * self.q
        self._copy_tokens(input_ids, positions, slot_mappings, num_tokens)
        self.seq_lens[:num_rows].copy_(seq_lens, non_blocking=True)
        self._reset_padding(num_rows, size)
        return self._replay((size, split_keys and size in self.split_sizes), num_tokens)

    def _reset_padding(self, num_rows: int, size: int) -> None:
        """Rows num_rows..size-1 back to the null row (a previous, larger batch may have used them)."""
        if num_rows == size:
            return
        tokens = slice(num_rows * self.q, size * self.q)
        self.input_ids[tokens].zero_()
        self.positions[tokens].zero_()
        self.slot_mappings[:, tokens].zero_()
        self.seq_lens[num_rows:size].fill_(self.q)
        self.block_tables[:, num_rows:size].zero_()
