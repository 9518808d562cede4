"""The runner's CUDA-graph buffers run eagerly (use_graphs=False), for engine tests off CUDA: decode graphs
(worker/cuda_graphs.py) or mixed-step graphs (worker/mixed_graphs.py) set on a runner, each run recorded."""

from __future__ import annotations

import torch

from llmserve.worker.cuda_graphs import DecodeGraphs
from llmserve.worker.mixed_graphs import MixedGraphs


def attach(runner, kind: str, max_blocks: int, max_batch: int = 4, max_tokens: int = 16, max_rows: int = 4,
           layer_groups: tuple[int, ...] | None = None, lora=None) -> list[tuple[int, int]]:
    """kind "decode": decode batches of up to max_batch rows; "mixed": steps of up to max_tokens tokens in up to
    max_rows rows. -> a list each run appends (its step's tokens, its padded size) to."""
    device = torch.device(runner.device)
    if kind == "decode":
        graphs = DecodeGraphs(runner.model, runner.attn_backend, runner.kv_caches, max_batch=max_batch,
                              max_blocks=max_blocks, device=device, use_graphs=False, layer_groups=layer_groups,
                              lora=lora)
        runner.graphs = graphs
    else:
        graphs = MixedGraphs(runner.model, runner.attn_backend, runner.kv_caches, max_tokens, max_rows, max_blocks,
                             runner.block_size, device, use_graphs=False, layer_groups=layer_groups, lora=lora)
        runner.mixed_graphs = graphs
    runs, replay = [], graphs._replay
    graphs._replay = lambda key, num_tokens: runs.append((num_tokens, key[0])) or replay(key, num_tokens)
    return runs
