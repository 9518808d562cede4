"""When the Triton attention kernels split rows' keys (flash decoding: model/triton_splits.py merges the parts):
the numbers only, without Triton, so that the CUDA graphs (worker/cuda_graphs.py) can decide which sizes get a
graph that splits."""

from __future__ import annotations

import os

MAX_SPLITS = 16
TARGET_PROGRAMS = 512  # enough programs to fill a large GPU's SMs a few times over
# a decode step whose longest row has this many keys splits them (predicted, not yet measured: docs/gpu.md);
# LLMSERVE_SPLIT_MIN_KEYS overrides it for an A/B (a number larger than any context: never split)
SPLIT_MIN_KEYS = int(os.environ.get("LLMSERVE_SPLIT_MIN_KEYS", "1024"))


def is_long_decode(max_query_len: int, seq_lens: list[int]) -> bool:
    """Whether a step's decode attention may split its rows' keys: every row one query, the longest row as long
    as SPLIT_MIN_KEYS (read at call time, so that a test can lower it)."""
    return max_query_len == 1 and max(seq_lens) >= SPLIT_MIN_KEYS


def num_splits_for(num_tiles: int, num_head_blocks: int, block_q: int) -> int:
    """Splits of each row's keys: decode steps (block_q 1) with few programs split their rows' keys so that about
    TARGET_PROGRAMS run (a power of 2, at most MAX_SPLITS); prompts and chunks (tiles of many queries) never do."""
    if block_q != 1:
        return 1
    wanted = -(-TARGET_PROGRAMS // max(1, num_tiles * num_head_blocks))
    return min(MAX_SPLITS, 1 << (wanted - 1).bit_length()) if wanted > 1 else 1
