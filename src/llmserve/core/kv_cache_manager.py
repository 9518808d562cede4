"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, freeing.

The scheduler asks `get_computed_blocks` once when a request is first scheduled, then
`allocate_slots` each step for the tokens it schedules; `free` when the request ends or is preempted.

A model whose every layer slides (a window of W keys) needs only the blocks of the last W tokens: as the
request advances, the blocks wholly before its window go back to the pool and its table holds the null
block there (the kernels never read before a window), so it holds about ceil(W / block_size) + 1 blocks
whatever its length, and a prefix hit needs only the window's blocks before the hit point.
"""

from __future__ import annotations

from llmserve.core.block_pool import BlockPool, KVBlock
from llmserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, sliding_window: int = 0) -> None:
        """sliding_window: the window of every layer (the largest where they differ); 0: some layer is full."""
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already in the hash index
        self.window_starts: dict[str, tuple[int, int]] = {}  # sliding: (computed tokens, null blocks) at the last drop
        self.num_queried_tokens = 0  # prefix-cache statistics, drained by the scheduler
        self.num_hit_tokens = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest chain of cached full blocks that starts the request's tokens.

        At least one token is always left to compute, so that the step produces logits.
        """
        if not self.enable_caching:
            return [], 0
        hashes = request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window:
            hits = self._window_hits(hashes[:max_blocks])
        else:
            hits = self._prefix_hits(hashes[:max_blocks])
        num_hit_tokens = len(hits) * self.block_size
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_tokens
        return hits, num_hit_tokens

    def _prefix_hits(self, hashes: list) -> list[KVBlock]:
        """Full attention: the cached blocks from the first one on, up to the first miss."""
        hits: list[KVBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _window_hits(self, hashes: list) -> list[KVBlock]:
        """Sliding window: the longest hit whose last cdiv(W - 1, block_size) blocks are cached (the keys the
        next query reads), or a run from the first block; null blocks stand before it. Scanned from the back,
        as vLLM's SlidingWindowManager does."""
        num_needed = max(1, cdiv(self.sliding_window - 1, self.block_size))
        hits = [self.pool.null_block] * len(hashes)
        num_run = 0
        for i in range(len(hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(hashes[i])
            if block is None:
                num_run = 0
                continue
            hits[i], num_run = block, num_run + 1
            if num_run == num_needed:
                return hits[:i + num_needed]
        return hits[:num_run]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` beyond the computed ones; None if blocks are short.

        `new_computed_blocks` are prefix hits (first scheduling only); they are referenced, not copied.
        `num_lookahead_tokens` more slots are reserved for a draft model's proposals in this step.
        """
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if self.sliding_window and blocks:
            self._drop_out_of_window(request, blocks)
        num_computed_tokens = request.num_computed_tokens + len(computed) * self.block_size
        num_needed = cdiv(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.block_size)
        if not computed and num_needed <= len(blocks):  # the common decode step: room in its last block
            self.cache_full_blocks(request, num_computed_tokens + num_new_tokens)
            return []
        num_new_blocks = max(0, num_needed - len(blocks) - len(computed))
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)  # the null block's is never 0
        if num_new_blocks + num_revived > self.pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch([b for b in computed if b is not self.pool.null_block])
        blocks.extend(computed)
        new_blocks = self.pool.allocate(num_new_blocks)
        blocks.extend(new_blocks)
        self.cache_full_blocks(request, num_computed_tokens + num_new_tokens)
        return new_blocks

    def grow(self, request: Request, num_slots: int) -> list[KVBlock]:
        """The new blocks that give a running request `num_slots` slots (a decode step's: no prefix hits,
        blocks the caller counted free)."""
        blocks = self.req_to_blocks[request.request_id]
        if self.sliding_window:
            self._drop_out_of_window(request, blocks)
        new_blocks = self.pool.allocate(max(0, cdiv(num_slots, self.block_size) - len(blocks)))
        blocks.extend(new_blocks)
        return new_blocks

    def _drop_out_of_window(self, request: Request, blocks: list[KVBlock]) -> None:
        """Give back the blocks wholly before the first key the next query reads (position
        num_computed_tokens - W + 1); the table keeps the null block in their place. Counted from the known
        tokens at most: drafts in flight may be rejected, which moves the next query back to the last one."""
        request_id = request.request_id
        num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        num_drop = min(len(blocks), max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size)
        num_done = self.window_starts.get(request_id, (0, 0))[1]
        self.window_starts[request_id] = (num_computed_tokens, max(num_drop, num_done))
        if num_drop <= num_done:
            return
        dropped = [b for b in blocks[num_done:num_drop] if b is not self.pool.null_block]
        blocks[num_done:num_drop] = [self.pool.null_block] * (num_drop - num_done)
        self.pool.free(dropped)  # oldest first: evicted before the later blocks of the chain

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the blocks that will be full once this step has run (their KV is written in it)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = request.update_block_hashes(self.block_size)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that eviction takes chain tails first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.window_starts.pop(request.request_id, None)
        self.pool.free([b for b in reversed(blocks) if b is not self.pool.null_block])

    def trim(self, request: Request, num_slots: int) -> int:
        """Give back the request's blocks past the first `num_slots` slots (rejected draft tokens);
        returns how many blocks it freed. Such blocks hold no full block of the request's tokens."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_slots, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return 0
        assert self.num_cached_blocks.get(request.request_id, 0) <= keep, "trimming a cached block"
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_front(list(reversed(tail)))
        return len(tail)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def usage(self) -> float:
        return self.pool.usage()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_prefix_stats(self) -> tuple[int, int]:
        stats = (self.num_queried_tokens, self.num_hit_tokens)
        self.num_queried_tokens = self.num_hit_tokens = 0
        return stats

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (the null block it has in place of dropped ones not counted)."""
        return sum(b is not self.pool.null_block for b in self.req_to_blocks.get(request_id, []))

    def check_integrity(self) -> None:
        """The pool's own checks; each block's ref count equals its holders; a sliding request holds nothing
        before its window and at most its window's blocks among the tokens computed at its last drop."""
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        for req_id, all_blocks in self.req_to_blocks.items():
            blocks = [b for b in all_blocks if b is not self.pool.null_block]
            for block in blocks:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
            assert len(blocks) == len(set(blocks)), "a request holds a block twice"
            if self.sliding_window:
                self._check_window(req_id, all_blocks)
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == owners.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != owners {owners.get(block.block_id, 0)}"

    def check_request(self, request: Request) -> None:
        """Sliding window: every block the request's next query reads is held (none is the null block)."""
        if not self.sliding_window:
            return
        num_next = min(request.num_computed_tokens, request.num_tokens - 1)  # its next query's position, at least
        first = max(0, num_next - self.sliding_window + 1) // self.block_size
        blocks = self.req_to_blocks.get(request.request_id, [])[first:cdiv(request.num_computed_tokens, self.block_size)]
        assert self.pool.null_block not in blocks, "a block the next query reads was given back"

    def _check_window(self, request_id: str, blocks: list[KVBlock]) -> None:
        num_computed_tokens, num_dropped = self.window_starts.get(request_id, (0, 0))
        null = self.pool.null_block
        assert all(b is null for b in blocks[:num_dropped]), "a sliding request holds a block before its window"
        num_held = sum(b is not null for b in blocks[:cdiv(num_computed_tokens, self.block_size)])
        assert num_held <= cdiv(self.sliding_window - 1, self.block_size) + 1, \
            f"a sliding request holds {num_held} blocks of its computed tokens, more than its window's"


def cache_window(layer_windows: list[int]) -> int:
    """The window the KV cache manager drops blocks by: the largest where every layer slides, else 0 (a full
    layer reads every block, so none can go back)."""
    if not layer_windows or 0 in layer_windows:
        return 0
    return max(layer_windows)
