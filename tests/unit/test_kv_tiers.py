"""The KV tiers below the device (host memory, disk) and the tiered connector over a small fake cache:
LRU order and byte budgets, checksummed disk files, collisions refused; saves run on the save thread, loads
on the loader thread once the step is scheduled."""

import os

import pytest
import torch

from llmserve.core.block_pool import BlockHash
from llmserve.core.kv_connector import KVBlockCopy
from llmserve.worker.kv_offload import TieredKVConnector, read_device_blocks
from llmserve.worker.kv_tiers import DiskTier, HostTier, block_nbytes

SHAPE = (2, 2, 4, 1, 3)  # [num_layers, 2, block_size, Hkv, D]


def _block(fill: float, dtype=torch.float32) -> torch.Tensor:
    return torch.full(SHAPE, fill, dtype=dtype)


def _hash(value: int) -> BlockHash:
    return BlockHash(value, (value, value + 1, value + 2, value + 3))


NBYTES = block_nbytes(_block(0))


def test_host_tier_evicts_least_recently_used_within_its_budget():
    host = HostTier(3 * NBYTES)
    for v in (1, 2, 3):
        assert host.put(_hash(v), _block(v)) == []
    assert host.get(_hash(1)) is not None  # 1 becomes the most recent: 2 goes first
    evicted = host.put(_hash(4), _block(4))
    assert [h.value for h, _ in evicted] == [2]
    assert host.get(_hash(2)) is None and len(host) == 3 and host.num_bytes == 3 * NBYTES
    host.check_integrity()


def test_host_tier_refuses_another_blocks_tokens_under_the_same_value():
    host = HostTier(4 * NBYTES)
    host.put(_hash(1), _block(1))
    assert host.get(BlockHash(1, (9, 9, 9, 9))) is None


def test_host_tier_returns_a_block_larger_than_its_budget():
    host = HostTier(NBYTES - 1)
    assert [h.value for h, _ in host.put(_hash(1), _block(1))] == [1]
    assert len(host) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_disk_tier_round_trip(tmp_path, dtype):
    disk = DiskTier(str(tmp_path), 1 << 20)
    disk.put(_hash(5), _block(1.5, dtype))
    back = disk.get(_hash(5))
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), _block(1.5, dtype).view(torch.uint8))
    disk.check_integrity()
    disk.close()
    assert not os.listdir(tmp_path)


def _corrupt_flip(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _corrupt_truncate(path: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])


@pytest.mark.parametrize("corrupt", [_corrupt_flip, _corrupt_truncate])
def test_disk_tier_detects_a_bad_file_and_drops_it(tmp_path, corrupt):
    disk = DiskTier(str(tmp_path), 1 << 20)
    disk.put(_hash(5), _block(1.0))
    corrupt(disk.path(5))
    assert disk.get(_hash(5)) is None
    assert disk.take_corrupt() == 1 and len(disk) == 0 and not os.path.exists(disk.path(5))
    disk.check_integrity()
    disk.close()


def test_disk_tier_deletes_the_oldest_files_within_its_budget(tmp_path):
    disk = DiskTier(str(tmp_path), 1 << 20)
    disk.put(_hash(1), _block(1))
    file_bytes = disk.num_bytes
    disk.close()
    disk = DiskTier(str(tmp_path), 2 * file_bytes)
    for v in (1, 2, 3):
        disk.put(_hash(v), _block(v))
    assert sorted(disk.files) == [2, 3] and disk.get(_hash(1)) is None
    disk.check_integrity()
    disk.close()


def _caches(num_blocks: int = 6) -> list[torch.Tensor]:
    """Two layers of [2, num_blocks, 4, 1, 3]; block b of layer l holds 10 * l + b."""
    layers = []
    for layer in range(2):
        cache = torch.zeros(2, num_blocks, 4, 1, 3)
        for b in range(num_blocks):
            cache[:, b] = 10 * layer + b
        layers.append(cache)
    return layers


def _load(conn: TieredKVConnector, loads: list[KVBlockCopy]) -> int:
    """A step's load: started when scheduled, run once the step is (apply); blocks read."""
    load = conn.start_load(loads)
    assert not load.done()  # queued until the step's apply
    conn.apply()
    return load.result(timeout=60)


def _save(conn: TieredKVConnector, saves: list[KVBlockCopy]) -> None:
    """Saves read off the device (the future), then in the tiers (wait_for_saves)."""
    conn.start_save(saves).result(timeout=60)
    conn.wait_for_saves()


def test_a_saved_block_is_loaded_back_into_another_device_block():
    caches = _caches()
    conn = TieredKVConnector(caches, HostTier(10 * NBYTES), None)
    conn.receive(_hash(7), read_device_blocks(caches, [5])[0])  # block 5's content, stored as hash 7
    _save(conn, [KVBlockCopy(2, _hash(3))])
    assert conn.num_matched_blocks([_hash(7), _hash(3), _hash(8)]) == 2
    assert _load(conn, [KVBlockCopy(1, _hash(7)), KVBlockCopy(4, _hash(3))]) == 2
    assert torch.equal(caches[1][:, 1], torch.full((2, 4, 1, 3), 15.0))
    assert torch.equal(caches[1][:, 4], torch.full((2, 4, 1, 3), 12.0))  # block 2's content
    stats = conn.take_stats()
    assert (stats.num_host_hit_tokens, stats.num_offloaded_blocks, stats.num_received_blocks) == (8, 1, 1)
    assert conn.take_stats() is None
    conn.check_integrity()


def test_a_matched_block_stays_loadable_when_a_save_pushes_it_out():
    caches = _caches()
    conn = TieredKVConnector(caches, HostTier(NBYTES), None)  # room for one block
    conn.receive(_hash(7), read_device_blocks(caches, [5])[0])
    assert conn.num_matched_blocks([_hash(7)]) == 1
    _save(conn, [KVBlockCopy(1, _hash(3))])
    assert _load(conn, [KVBlockCopy(4, _hash(7))]) == 1
    assert torch.equal(caches[0][:, 4], caches[0][:, 5])
    assert conn.host.get(_hash(7)) is None and conn.host.get(_hash(3)) is not None
    conn.check_integrity()


def test_host_evictions_are_demoted_to_disk_and_found_there(tmp_path):
    caches = _caches()
    conn = TieredKVConnector(caches, HostTier(NBYTES), DiskTier(str(tmp_path), 1 << 20))
    _save(conn, [KVBlockCopy(1, _hash(1)), KVBlockCopy(2, _hash(2))])
    assert len(conn.host) == 1 and len(conn.disk) == 1
    assert conn.num_matched_blocks([_hash(1), _hash(2)]) == 2
    assert _load(conn, [KVBlockCopy(4, _hash(1)), KVBlockCopy(5, _hash(2))]) == 2
    assert torch.equal(caches[1][:, 4], torch.full((2, 4, 1, 3), 11.0))
    assert torch.equal(caches[1][:, 5], torch.full((2, 4, 1, 3), 12.0))
    stats = conn.take_stats()
    assert (stats.num_host_hit_tokens, stats.num_disk_hit_tokens) == (4, 4)
    conn.check_integrity()
    conn.close()


def test_blocks_matched_but_not_loaded_are_let_go_at_the_next_apply():
    caches = _caches()
    conn = TieredKVConnector(caches, HostTier(10 * NBYTES), None)
    conn.receive(_hash(7), read_device_blocks(caches, [5])[0])
    assert conn.num_matched_blocks([_hash(7)]) == 1  # the request then found no room (or was aborted)
    with pytest.raises(AssertionError, match="held aside"):
        conn.check_integrity()
    conn.apply()
    conn.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int8])
def test_every_cache_dtype_copies_out_and_back_bit_for_bit(dtype):
    """fp16 / fp8 / int8 KV caches (--kv-cache-dtype): float8 has no index_copy_ on CPU, copied as bytes."""
    caches = [cache.to(dtype) for cache in _caches()]
    conn = TieredKVConnector(caches, HostTier(10 * NBYTES), None)
    _save(conn, [KVBlockCopy(3, _hash(3))])
    assert conn.num_matched_blocks([_hash(3)]) == 1
    assert _load(conn, [KVBlockCopy(1, _hash(3))]) == 1
    for cache in caches:
        assert torch.equal(cache[:, 1].view(torch.uint8), cache[:, 3].view(torch.uint8))
