"""The tiered KV connector: blocks evicted from the device's prefix cache go to host memory (and, evicted
from there, to disk); a prefix hit in a lower tier is copied back into device blocks before the step's
forward instead of recomputed (core/kv_connector.py has the contract).

The copies run on the step loop's thread, before the forward (on CUDA they are ordered on the current
stream, from and to pinned memory). A decode server of a disaggregated pair (engine/kv_transfer.py) also
puts the blocks its prefill server sends into the host tier, from its receiver thread: every tier access
holds `lock`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from llmserve.core.block_pool import BlockHash
from llmserve.core.kv_connector import KVConnector, KVTransfers
from llmserve.messages import KVTierStats
from llmserve.worker.kv_tiers import DiskTier, HostTier


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte dtype's tensor as uint8 (same shape): torch has no index_copy_ or stack for float8 on CPU."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


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
        self.matched: dict[int, tuple[torch.Tensor, str]] = {}  # hash value -> (block, tier) until the next apply
        self.stats = KVTierStats()

    # ---- scheduler side ---------------------------------------------------------------------

    def num_matched_blocks(self, hashes: Sequence[BlockHash]) -> int:
        with self.lock:
            for i, block_hash in enumerate(hashes):
                if block_hash.value not in self.matched and not self._match(block_hash):
                    return i
            return len(hashes)

    def _match(self, block_hash: BlockHash) -> bool:
        """Hold the block aside for this step's load (a disk block is read and checked now, so a corrupt one
        is a miss before the scheduler counts it)."""
        for name, tier in (("host", self.host), ("disk", self.disk)):
            block = tier.get(block_hash) if tier is not None else None
            if block is not None:
                self.matched[block_hash.value] = (block, name)
                return True
        return False

    # ---- worker side ----------------------------------------------------------------------------

    def apply(self, transfers: KVTransfers) -> None:
        saved = read_device_blocks(self.kv_caches, [c.block_id for c in transfers.saves])
        block_size = self.kv_caches[0].shape[2]
        with self.lock:
            loads = [(c.block_id, self.matched[c.block_hash.value]) for c in transfers.loads]
            self.matched.clear()
            for copy, block in zip(transfers.saves, saved):
                self._keep(copy.block_hash, block)
            self.stats.num_offloaded_blocks += len(saved)
            self.stats.num_host_hit_tokens += block_size * sum(tier == "host" for _, (_, tier) in loads)
            self.stats.num_disk_hit_tokens += block_size * sum(tier == "disk" for _, (_, tier) in loads)
            if self.disk is not None:
                self.stats.num_corrupt_blocks += self.disk.take_corrupt()
        write_device_blocks(self.kv_caches, [block_id for block_id, _ in loads], [block for _, (block, _) in loads])

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
            stats, self.stats = self.stats, KVTierStats()
        return None if stats == KVTierStats() else stats

    def reset(self) -> None:
        with self.lock:
            self.matched.clear()
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.clear()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def check_integrity(self) -> None:
        with self.lock:
            assert not self.matched, "blocks held aside past the step that matched them"
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.check_integrity()
