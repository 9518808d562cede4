"""The pool of KV blocks: ref counts, an O(1) free list, and the prefix-cache hash index.

A block is free when its ref count is 0. Free blocks sit in a queue ordered for eviction
(least recently freed first); a free block may still hold cached KV (it has a hash) and is "revived" by
a prefix hit, which removes it from the middle of the queue in O(1).
Block 0 is the null block: never handed out, used to pad block tables.
With KV cache groups (core/kv_cache_groups.py) a block holds one group's KV, so the index is keyed by
group and hash (`cache_key`): the same tokens have one cached block per group.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple


def cache_key(group: int, hash_value: int) -> int | tuple[int, int]:
    """The hash index's key: the hash itself for group 0 (a model's only group unless it mixes attention kinds:
    no tuple made per block there), (group, hash) for the others."""
    return hash_value if group == 0 else (group, hash_value)


class BlockHash(NamedTuple):
    """Identity of a full block: hash of (parent hash, its token ids, salt), plus the tokens
    themselves so that a hit is confirmed token by token (a hash collision is never served). A named
    tuple: made for every block a sequence fills, a few times cheaper to make than a frozen dataclass."""

    value: int
    token_ids: tuple[int, ...]


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the KV cache group whose KV it holds, while it has a hash
    is_saved: bool = False  # its KV went to a KV connector's store when its last holder let go (core/kv_saving.py)


class FreeBlockQueue:
    """Free blocks in eviction order, with O(1) popleft, append, appendleft and remove-from-middle: an
    OrderedDict keyed by block id. Blocks hold no links to each other, so a pool that is dropped is freed
    by reference counting alone (the engine freezes its start-up heap out of the cyclic collector's
    passes: llmserve/heap.py)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._queue)

    def popleft(self) -> KVBlock:
        assert self._queue, "no free blocks"
        return self._queue.popitem(last=False)[1]

    def remove(self, block: KVBlock) -> None:
        removed = self._queue.pop(block.block_id, None)
        assert removed is block, "block not in queue"

    def append(self, block: KVBlock) -> None:
        assert block.block_id not in self._queue, "block already queued"
        self._queue[block.block_id] = block

    def appendleft(self, block: KVBlock) -> None:
        self.append(block)
        self._queue.move_to_end(block.block_id, last=False)

    def block_ids(self) -> list[int]:
        return list(self._queue)


class BlockPool:
    """All KV blocks; hands out free ones, evicting cached KV least-recently-used first."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        assert num_blocks >= 2, "need the null block and at least one more"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int | tuple[int, int], KVBlock] = {}  # cache_key(group, hash) -> block holding that KV

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVBlock | None:
        """The block holding the group's KV of exactly these tokens after this parent, or None."""
        block = self.cached.get(cache_key(group, block_hash.value))
        if block is None or block.block_hash != block_hash:  # tokens differ: a collision
            return None
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving the free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        assert num_blocks <= self.get_num_free_blocks(), "allocate beyond free blocks"
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue's tail in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def free_front(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; uncached blocks reaching 0 go to the queue's head, so that the
        next allocation reuses them before it evicts any cached KV (rejected draft slots)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group: int = 0) -> None:
        """Record that `block` holds the group's KV of `block_hash` (a full block). First writer wins."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        key = cache_key(group, block_hash.value)
        if key in self.cached:
            return  # same content computed twice (or a collision): keep the first
        block.block_hash, block.group = block_hash, group
        self.cached[key] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        key = cache_key(block.group, block.block_hash.value)
        if self.cached.get(key) is block:
            del self.cached[key]
        block.block_hash, block.is_saved = None, False

    def reset_prefix_cache(self) -> bool:
        """Forget all cached KV; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        for block in self.blocks[1:]:
            block.block_hash, block.is_saved = None, False
        self.cached.clear()
        return True

    def check_integrity(self) -> None:
        queued = self.free_queue.block_ids()
        assert len(queued) == len(set(queued)), "a block is queued twice"
        assert 0 not in queued, "the null block is in the free queue"
        free_ids = {b.block_id for b in self.blocks[1:] if b.ref_cnt == 0}
        assert set(queued) == free_ids, "free queue differs from blocks with ref_cnt 0"
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        for key, block in self.cached.items():
            assert block.block_hash is not None and key == cache_key(block.group, block.block_hash.value), \
                "stale hash index"
