"""The tiered KV connector: cached blocks the device lets go of are saved to host memory (and, evicted from
there, to disk); a prefix hit in a lower tier is copied back into device blocks instead of recomputed
(core/kv_connector.py has the contract).

Saves run on a save thread: it reads the blocks off the device (the scheduler keeps them from reuse until
then: core/kv_saving.py) and keeps them in the tiers, disk writes included, off the step loop. Loads run on a
loader thread while the steps go on: it reads disk blocks (checking each file) and copies into the request's
device blocks, which nothing else reads or writes meanwhile. On CUDA each thread copies on a side stream of
its own and waits on the stream's event (a save's stream first waits for what the step loop's stream had
queued when the save started: the steps that wrote the blocks), so the step loop's stream never waits. A
decode server of a disaggregated pair (engine/kv_transfer.py) also puts the blocks its prefill server sends
into the host tier, from its receiver thread: every tier access holds `lock`.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from llmserve.core.block_pool import BlockHash
from llmserve.core.kv_connector import KVBlockCopy, KVConnector
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
        self.saver = ThreadPoolExecutor(1, thread_name_prefix="kv-save")  # saves in order, apart from loads
        self.saving: list[Future[None]] = []  # save jobs (copy out, then into the tiers) not known to be done
        is_cuda = kv_caches[0].device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(kv_caches[0].device) if is_cuda else None
        self.save_stream = torch.cuda.Stream(kv_caches[0].device) if is_cuda else None

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
        """Queued until this step's `apply` (the step's scheduling is done with the blocks held aside). The
        future counts blocks of every group (a position counts once all its groups' arrived)."""
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

    def start_save(self, saves: list[KVBlockCopy]) -> Future[None]:
        """On CUDA the copy waits for what the step loop's stream has queued so far (the steps that wrote
        the blocks), not for the host."""
        read: Future[None] = Future()
        written = None
        if self.save_stream is not None:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.kv_caches[0].device))
        self.saving = [job for job in self.saving if not job.done()]
        self.saving.append(self.saver.submit(self._save, read, saves, written))
        return read

    def _save(self, read: Future[None], saves: list[KVBlockCopy], written) -> None:
        """On the save thread: the blocks copied off the device, which lets the device blocks go (`read`), then
        kept in the tiers (host memory; what that pushes out, or all without it, written to disk)."""
        if not read.set_running_or_notify_cancel():
            return
        try:
            blocks = self._read_device(saves, written)
        except Exception as error:  # the blocks are not kept; a later request computes them
            read.set_exception(error)
            return
        read.set_result(None)
        for copy, block in zip(saves, blocks):
            with self.lock:  # a block at a time: the step loop's lookups wait for one write at most
                self._keep(tier_hash(copy.block_hash, copy.group), block)
                self.stats.num_offloaded_blocks += 1

    def _read_device(self, saves: list[KVBlockCopy], written) -> list[torch.Tensor]:
        block_ids = [copy.block_id for copy in saves]
        if self.save_stream is None:
            return read_device_blocks(self.kv_caches, block_ids)
        with torch.cuda.stream(self.save_stream):
            self.save_stream.wait_event(written)
            return read_device_blocks(self.kv_caches, block_ids)  # to the host: this thread waits for the copy

    # ---- worker side ----------------------------------------------------------------------------

    def apply(self) -> None:
        with self.lock:
            self.matched.clear()
        queued, self.queued = self.queued, []
        for load in queued:
            self.loader.submit(self._run_load, *load)

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        concurrent.futures.wait(self.saving, timeout)
        self.saving = [job for job in self.saving if not job.done()]
        return not self.saving

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
        self.wait_for_saves()  # a save that ended later would put back what the reset dropped
        with self.lock:
            self.matched.clear()
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.clear()

    def close(self) -> None:
        self.loader.shutdown(wait=True)  # a copy in flight writes into the cache until it ends
        self.saver.shutdown(wait=True)  # and one reads it, then writes to disk
        if self.disk is not None:
            self.disk.close()

    def check_integrity(self) -> None:
        with self.lock:
            assert not self.matched, "blocks held aside past the step that matched them"
            assert not self.queued, "loads queued past the step that started them"
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.check_integrity()
