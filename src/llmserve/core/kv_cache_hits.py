"""Prefix-cache hits across KV cache groups (core/kv_cache_groups.py), as vLLM's hybrid coordinator finds them.

A full-attention group hits on the cached blocks from the first one on, up to the first miss (a hit of n
blocks holds for every shorter length too). A sliding group of window W needs only the blocks the next query
reads: a hit of n blocks needs blocks n - cdiv(W - 1, block_size) .. n - 1 cached (null blocks stand before
them), found scanning from the back (vLLM's SlidingWindowManager). The request's hit is the longest length
every group serves: each group in turn cuts the length to its own longest hit within it, until no group
cuts it further (a sliding group's hit at a shorter length is looked for again: its window moved).
"""

from __future__ import annotations

from llmserve.core.block_pool import BlockHash, BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def longest_hit(pool: BlockPool, hashes: list[BlockHash], group_windows: tuple[int, ...],
                block_size: int) -> list[KVBlock]:
    """The hit blocks, groups interleaved (entry i * G + g: group g's block i); n * G of them for a hit of
    n blocks."""
    num_blocks = len(hashes)
    while True:
        num_before = num_blocks
        group_hits = []
        for group, window in enumerate(group_windows):
            hits = _window_hits(pool, hashes[:num_blocks], group, window, block_size) if window \
                else _prefix_hits(pool, hashes[:num_blocks], group)
            group_hits.append(hits)
            num_blocks = len(hits)
        if num_blocks == num_before:  # every group served this length
            break
    if len(group_hits) == 1:
        return group_hits[0]
    return [hits[i] for i in range(num_blocks) for hits in group_hits]


def _prefix_hits(pool: BlockPool, hashes: list[BlockHash], group: int) -> list[KVBlock]:
    """Full attention: the cached blocks from the first one on, up to the first miss."""
    hits: list[KVBlock] = []
    for block_hash in hashes:
        block = pool.get_cached_block(block_hash, group)
        if block is None:
            break
        hits.append(block)
    return hits


def _window_hits(pool: BlockPool, hashes: list[BlockHash], group: int, window: int,
                 block_size: int) -> list[KVBlock]:
    """Sliding window: the longest hit whose last cdiv(W - 1, block_size) blocks are cached (the keys the
    next query reads), or a run from the first block; null blocks stand before it."""
    num_needed = max(1, cdiv(window - 1, block_size))
    hits = [pool.null_block] * len(hashes)
    num_run = 0
    for i in range(len(hashes) - 1, -1, -1):
        block = pool.get_cached_block(hashes[i], group)
        if block is None:
            num_run = 0
            continue
        hits[i], num_run = block, num_run + 1
        if num_run == num_needed:
            return hits[:i + num_needed]
    return hits[:num_run]
