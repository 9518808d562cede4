"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, freeing.

The scheduler asks `get_computed_blocks` once when a request is first scheduled, then
`allocate_slots` each step for the tokens it schedules; `free` when the request ends or is preempted.

KV cache groups (core/kv_cache_groups.py): each group of layers has its own blocks per request. A request's
blocks are kept in one list, the groups interleaved: entry i * G + g is group g's block for tokens
i * block_size .. (i + 1) * block_size - 1, so every group always has the same number of block positions
and the runner's diffs (new blocks after the old ones, trimmed tails) stay one list of ids. With one group
(every model whose layers are all of one kind) the list is the request's blocks as before.

A sliding group (a window of W keys) needs only the blocks of the last W tokens: as the request advances,
its blocks wholly before the window go back to the pool and its positions hold the null block (the kernels
never read before a window), so it holds about ceil(W / block_size) + 1 blocks whatever the length, and a
prefix hit needs only the window's blocks before the hit point (vLLM's rule; core/kv_cache_hits.py).
"""

from __future__ import annotations

from llmserve.core.block_pool import BlockPool, KVBlock
from llmserve.core.kv_cache_hits import cdiv, longest_hit
from llmserve.core.kv_saving import KVSaves
from llmserve.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 group_windows: tuple[int, ...] = (0,)) -> None:
        """group_windows: each KV cache group's window (0: full attention); one group of every layer by default."""
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.sliding_groups = [g for g, window in enumerate(self.group_windows) if window]
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}  # groups interleaved (module docstring)
        self.num_cached_blocks: dict[str, int] = {}  # block positions of the request already in the hash index
        # sliding groups: (computed tokens, block positions given back per sliding group) at the last drop
        self.window_starts: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.saves: KVSaves | None = None  # with a KV connector: blocks held while their KV is copied out
        self.num_queried_tokens = 0  # prefix-cache statistics, drained by the scheduler
        self.num_hit_tokens = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix every group serves (core/kv_cache_hits.py), groups interleaved.

        At least one token is always left to compute, so that the step produces logits.
        """
        if not self.enable_caching:
            return [], 0
        hashes = request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = longest_hit(self.pool, hashes[:max_blocks], self.group_windows, self.block_size)
        num_hit_tokens = len(hits) // self.num_groups * self.block_size
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` beyond the computed ones; None if blocks are short (every group's
        new blocks counted, after the sliding groups gave back what left their window).

        `new_computed_blocks` are prefix hits (first scheduling only); they are referenced, not copied.
        `num_lookahead_tokens` more slots are reserved for a draft model's proposals in this step.
        """
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if self.sliding_groups and blocks:
            self._drop_out_of_window(request, blocks)
        num_groups = self.num_groups
        num_computed_tokens = request.num_computed_tokens + len(computed) // num_groups * self.block_size
        num_needed = cdiv(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_held = len(blocks) // num_groups  # block positions
        if not computed and num_needed <= num_held:  # the common decode step: room in its last block
            self.cache_full_blocks(request, num_computed_tokens + num_new_tokens)
            return []
        num_new_blocks = max(0, num_needed - num_held - len(computed) // num_groups) * num_groups
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

    def allocate_for_load(self, request: Request, hits: list[KVBlock], num_positions: int) -> list[KVBlock] | None:
        """Reference the prefix hits and allocate `num_positions` block positions after them (every group's)
        for a KV connector's load; None if blocks are short. Unlike `allocate_slots`, the new blocks are not
        indexed: their KV is not there yet (`cache_full_blocks` once it is)."""
        assert request.request_id not in self.req_to_blocks, "a load's blocks are its request's first"
        num_new_blocks = num_positions * self.num_groups
        if num_new_blocks + sum(1 for b in hits if b.ref_cnt == 0) > self.pool.get_num_free_blocks():
            return None
        self.pool.touch([b for b in hits if b is not self.pool.null_block])
        new_blocks = self.pool.allocate(num_new_blocks)
        self.req_to_blocks[request.request_id] = hits + new_blocks
        self.num_cached_blocks[request.request_id] = len(hits) // self.num_groups
        return new_blocks

    def grow(self, request: Request, num_slots: int) -> list[KVBlock]:
        """The new blocks that give a running request `num_slots` slots (a multi-step's: no prefix hits,
        blocks the caller counted free: `num_blocks_to_grow`)."""
        blocks = self.req_to_blocks[request.request_id]
        if self.sliding_groups:
            self._drop_out_of_window(request, blocks)
        new_blocks = self.pool.allocate(self.num_blocks_to_grow(request, num_slots))
        blocks.extend(new_blocks)
        return new_blocks

    def num_blocks_to_grow(self, request: Request, num_slots: int) -> int:
        """New blocks (of every group) that `grow` takes for `num_slots` slots, before any drop."""
        num_held = len(self.req_to_blocks[request.request_id]) // self.num_groups
        return max(0, cdiv(num_slots, self.block_size) - num_held) * self.num_groups

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's block positions hold."""
        return len(self.req_to_blocks.get(request_id, ())) // self.num_groups * self.block_size

    def _drop_out_of_window(self, request: Request, blocks: list[KVBlock]) -> None:
        """Give back each sliding group's blocks wholly before the first key the next query reads (position
        num_computed_tokens - W + 1); the null block takes their place. Counted from the known tokens at
        most: drafts in flight may be rejected, which moves the next query back to the last one."""
        request_id, null = request.request_id, self.pool.null_block
        num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        num_positions = len(blocks) // self.num_groups
        num_done = self.window_starts.get(request_id, (0, (0,) * len(self.sliding_groups)))[1]
        num_drops, dropped = [], []
        for group, done in zip(self.sliding_groups, num_done):
            window = self.group_windows[group]
            num_drop = max(done, min(num_positions, max(0, num_computed_tokens - window + 1) // self.block_size))
            num_drops.append(num_drop)
            for i in range(done * self.num_groups + group, num_drop * self.num_groups, self.num_groups):
                if blocks[i] is not null:
                    dropped.append(blocks[i])
                    blocks[i] = null
        self.window_starts[request_id] = (num_computed_tokens, tuple(num_drops))
        self.pool.free(self._let_go(dropped))  # oldest first: evicted before the later blocks of the chain

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the blocks that will be full once this step has run (their KV is written in it)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = request.update_block_hashes(self.block_size)
        blocks, num_groups = self.req_to_blocks[request.request_id], self.num_groups
        if num_groups == 1:
            for i in range(start, num_full):
                self.pool.cache_block(blocks[i], hashes[i])
        else:
            for i in range(start, num_full):
                for group in range(num_groups):
                    self.pool.cache_block(blocks[i * num_groups + group], hashes[i], group)
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that eviction takes chain tails first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.window_starts.pop(request.request_id, None)
        self.pool.free(self._let_go([b for b in reversed(blocks) if b is not self.pool.null_block]))

    def _let_go(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """The blocks to give back to the pool; with a KV connector, those whose KV goes to it are held for
        their save instead (core/kv_saving.py)."""
        return blocks if self.saves is None else self.saves.hold(blocks)

    def trim(self, request: Request, num_slots: int) -> int:
        """Give back the request's blocks past the first `num_slots` slots (rejected draft tokens);
        returns how many blocks it freed. Such blocks hold no full block of the request's tokens."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_slots, self.block_size)
        if blocks is None or len(blocks) <= keep * self.num_groups:
            return 0
        assert self.num_cached_blocks.get(request.request_id, 0) <= keep, "trimming a cached block"
        tail = blocks[keep * self.num_groups:]
        del blocks[keep * self.num_groups:]
        self.pool.free_front(list(reversed(tail)))
        return len(tail)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, groups interleaved (what the runner's block table holds)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def usage(self) -> float:
        return self.pool.usage()

    def reset_prefix_cache(self) -> bool:
        """Refused (False) while a request holds blocks; saves in flight are waited for first, those not started
        dropped (the cache they would keep is being forgotten)."""
        if self.req_to_blocks:
            return False
        if self.saves is not None:
            self.saves.drain()
        return self.pool.reset_prefix_cache()

    def take_prefix_stats(self) -> tuple[int, int]:
        stats = (self.num_queried_tokens, self.num_hit_tokens)
        self.num_queried_tokens = self.num_hit_tokens = 0
        return stats

    def num_held_blocks(self, request_id: str, group: int | None = None) -> int:
        """Blocks the request holds, of one group or all (the null block in place of dropped ones not counted)."""
        blocks = self.req_to_blocks.get(request_id, [])
        if group is not None:
            blocks = blocks[group::self.num_groups]
        return sum(b is not self.pool.null_block for b in blocks)

    def check_integrity(self) -> None:
        """The pool's own checks; each block's ref count equals its holders; every group has as many block
        positions; a sliding group holds nothing before its window and at most its window's blocks among the
        tokens computed at its last drop."""
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        if self.saves is not None:
            self.saves.check_integrity()
            for block in self.saves.held_blocks():  # a save holds its blocks until their copy ends
                owners[block.block_id] = 1
        for req_id, all_blocks in self.req_to_blocks.items():
            assert len(all_blocks) % self.num_groups == 0, "the groups hold different numbers of block positions"
            blocks = [b for b in all_blocks if b is not self.pool.null_block]
            for block in blocks:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
            assert len(blocks) == len(set(blocks)), "a request holds a block twice"
            if self.sliding_groups:
                self._check_window(req_id, all_blocks)
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == owners.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != owners {owners.get(block.block_id, 0)}"

    def check_request(self, request: Request) -> None:
        """Sliding groups: every block the request's next query reads is held (none is the null block); full
        groups: every block of its computed tokens."""
        num_next = min(request.num_computed_tokens, request.num_tokens - 1)  # its next query's position, at least
        end = cdiv(request.num_computed_tokens, self.block_size)
        blocks = self.req_to_blocks.get(request.request_id, [])
        for group, window in enumerate(self.group_windows):
            first = max(0, num_next - window + 1) // self.block_size if window else 0
            read = blocks[first * self.num_groups + group:end * self.num_groups:self.num_groups]
            assert self.pool.null_block not in read, f"a block group {group}'s next query reads was given back"

    def _check_window(self, request_id: str, blocks: list[KVBlock]) -> None:
        num_computed_tokens, num_dropped = self.window_starts.get(request_id, (0, (0,) * len(self.sliding_groups)))
        null, num_groups = self.pool.null_block, self.num_groups
        for group, done in zip(self.sliding_groups, num_dropped):
            group_blocks = blocks[group::num_groups]
            assert all(b is null for b in group_blocks[:done]), "a sliding group holds a block before its window"
            num_held = sum(b is not null for b in group_blocks[:cdiv(num_computed_tokens, self.block_size)])
            assert num_held <= cdiv(self.group_windows[group] - 1, self.block_size) + 1, \
                f"a sliding group holds {num_held} blocks of its computed tokens, more than its window's"
