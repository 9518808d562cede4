"""The tiered KV connector: blocks evicted from the device's prefix cache go to host memory (and, evicted
from there, to disk); a prefix hit in a lower tier is copied back into device blocks before the step's
forward instead of recomputed (core/kv_connector.py has the contract).

Saves run on the step loop's thread, before the forward (the evicted blocks are read before anything
overwrites them). Loads run on a loader thread while the steps go on: it reads disk blocks (checking each
file) and copies into the request's device blocks, which nothing else reads or writes meanwhile; on CUDA the
copy runs on a side stream of its own, from pinned memory, and the thread waits on the stream's event, so
the load is done (and its request schedulable) only once the blocks are on the device. A decode server of a disaggregated pair (engine/kv_transfer.py) also
puts the blocks its prefill server sends into the host tier, from its receiver thread: every tier access
holds `lock`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from llmserve.core.block_pool import BlockHash
from llmserve.core.kv_connector import KVBlockCopy, KVConnector, KVTransfers
from llmserve.messages import KVTierStats
from llmserve.worker.kv_tiers import DiskTier, HostTier


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte dtype's tensor as uint8 (same shape): torch has no index_copy_ or stack for float8 on CPU."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def tier_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The tiers' key of one KV cache group's block of these tokens: the prefix cache's hash for group 0 (the
    only one of most models), a hash of (group, hash) for the others (each group's block of the same tokens
    holds other layers). Its token ids are the block's, compared on lookup. Made in the process that keeps the
    block (a prefill server sends hash and group apart): the string's hash differs between processes."""
    return block_hash if group == 0 else BlockHash(hash(("kv-group", group, block_hash.value)), block_hash.token_ids)


def read_device_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """Host copies of device blocks, one [num_layers, 2, block_size, Hkv, D] tensor each."""
    if not block_ids:
        return []
    index = torch.tensor(block_ids, device=kv_caches[0].device)
    stacked = torch.stack([as_bytes(cache).index_select(1, index) for cache in kv_caches])  # [L, 2, n, bs, Hkv, D]
    stacked = stacked.to("cpu").movedim(2, 0)  # [n, L, 2, bs, Hkv, D]
    return [block.contiguous().view(kv_caches[0].dtype) for block in stacked]


def write_device_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], blocks: list[torch.Tensor]) -> None:
    """Copy host blocks ([num_layers, 2, block_size, Hkv, D] each) into the device blocks `block_ids`."""
    if not block_ids:
        return
    device = kv_caches[0].device
    index = torch.tensor(block_ids, device=device)
    data = torch.stack([as_bytes(block) for block in blocks]).to(device, non_blocking=True)  # [n, L, 2, bs, Hkv, D]
    for layer, cache in enumerate(kv_caches):
        as_bytes(cache).index_copy_(1, index, data[:, layer].movedim(0, 1))  # [2, n, bs, Hkv, D]


class TieredKVConnector(KVConnector):
    def __init__(self, kv_caches: list[torch.Tensor], host: HostTier | None, disk: DiskTier | None) -> None:
        assert host is not None or disk is not None, "a tiered connector needs a tier"
        self.kv_caches = kv_caches
        self.host, self.disk = host, disk
        self.lock = threading.Lock()
        # hash value -> (block, or None for a disk block read when loaded) until the next apply or load
        self.matched: dict[int, torch.Tensor | None] = {}
        self.stats = KVTierStats()
        self.queued: list[tuple[Future[int], list[KVBlockCopy], list[torch.Tensor | None]]] = []  # until apply
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        is_cuda = kv_caches[0].device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(kv_caches[0].device) if is_cuda else None

    # ---- scheduler side ---------------------------------------------------------------------

    def num_matched_blocks(self, hashes: Sequence[BlockHash], num_groups: int = 1) -> int:
        with self.lock:
            for i, block_hash in enumerate(hashes):
                for group in range(num_groups):
                    key = tier_hash(block_hash, group)
                    if key.value not in self.matched and not self._match(key):
                        return i
            return len(hashes)

    def _match(self, key: BlockHash) -> bool:
        """Hold the block aside for this step's load: a host block's tensor, or a disk block's name (its file is
        read and checked by the load, off the step loop)."""
        block = self.host.get(key) if self.host is not None else None
        if block is None and not (self.disk is not None and self.disk.has(key)):
            return False
        self.matched[key.value] = block
        return True

    def start_load(self, loads: list[KVBlockCopy]) -> Future[int]:
        """Queued until this step's `apply` has copied its saves out: a load may go into a block this step
        evicted. The future counts blocks of every group (a position counts once all its groups' arrived)."""
        load: Future[int] = Future()
        with self.lock:
            blocks = [self.matched.pop(tier_hash(copy.block_hash, copy.group).value) for copy in loads]
        self.queued.append((load, loads, blocks))
        return load

    def _run_load(self, load: Future[int], loads: list[KVBlockCopy], blocks: list[torch.Tensor | None]) -> None:
        if load.set_running_or_notify_cancel():
            try:
                load.set_result(self._load(loads, blocks))
            except Exception as error:  # the request computes its prompt instead (core/kv_loading.py)
                load.set_exception(error)

    def _load(self, loads: list[KVBlockCopy], blocks: list[torch.Tensor | None]) -> int:
        """On the loader thread: the blocks, read from disk where not in memory, up to the first that fails its
        checks, copied into their device blocks; how many."""
        found = self._read(loads, blocks)
        self._write(loads[:len(found)], found)
        firsts = [block is None for copy, block in zip(loads, blocks[:len(found)]) if copy.group == 0]
        with self.lock:  # tokens: a position counts once, in its group 0 block
            block_size = self.kv_caches[0].shape[2]
            self.stats.num_host_hit_tokens += block_size * (len(firsts) - sum(firsts))
            self.stats.num_disk_hit_tokens += block_size * sum(firsts)
        return len(found)

    def _read(self, loads: list[KVBlockCopy], blocks: list[torch.Tensor | None]) -> list[torch.Tensor]:
        found = []
        for copy, block in zip(loads, blocks):
            block = block if block is not None else self.disk.read(tier_hash(copy.block_hash, copy.group), self.lock)
            if block is None:
                break
            found.append(block)
        return found

    def _write(self, loads: list[KVBlockCopy], blocks: list[torch.Tensor]) -> None:
        block_ids = [copy.block_id for copy in loads]
        if self.copy_stream is None:
            write_device_blocks(self.kv_caches, block_ids, blocks)
            return
        with torch.cuda.stream(self.copy_stream):
            write_device_blocks(self.kv_caches, block_ids, blocks)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        done.synchronize()  # this thread waits; the step loop's stream never does

    # ---- worker side ----------------------------------------------------------------------------

    def apply(self, transfers: KVTransfers) -> None:
        saved = read_device_blocks(self.kv_caches, [c.block_id for c in transfers.saves])
        with self.lock:
            self.matched.clear()
            for copy, block in zip(transfers.saves, saved):
                self._keep(tier_hash(copy.block_hash, copy.group), block)
            self.stats.num_offloaded_blocks += len(saved)
        queued, self.queued = self.queued, []
        for load in queued:
            self.loader.submit(self._run_load, *load)

    def _keep(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        """Into host memory; what that evicts (or all, without a host tier) onto disk."""
        demoted = [(block_hash, block)] if self.host is None else self.host.put(block_hash, block)
        if self.disk is not None:
            for old_hash, old_block in demoted:
                self.disk.put(old_hash, old_block)

    def receive(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        """A block another engine computed (a prefill server's): kept as an evicted block would be."""
        with self.lock:
            self._keep(block_hash, block)
            self.stats.num_received_blocks += 1

    def take_stats(self) -> KVTierStats | None:
        with self.lock:
            if self.disk is not None:
                self.stats.num_corrupt_blocks += self.disk.take_corrupt()
            stats, self.stats = self.stats, KVTierStats()
        return None if stats == KVTierStats() else stats

    def reset(self) -> None:
        with self.lock:
            self.matched.clear()
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.clear()

    def close(self) -> None:
        self.loader.shutdown(wait=True)  # a copy in flight writes into the cache until it ends
        if self.disk is not None:
            self.disk.close()

    def check_integrity(self) -> None:
        with self.lock:
            assert not self.matched, "blocks held aside past the step that matched them"
            assert not self.queued, "loads queued past the step that started them"
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.check_integrity()
