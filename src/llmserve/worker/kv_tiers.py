"""The tiers below the device's KV cache: host memory and disk, each an LRU of whole blocks under a byte budget.

A block is one tensor [num_layers, 2, block_size, Hkv, D] on the host, keyed by its BlockHash's value; the
BlockHash itself (token ids included) is kept beside it and compared on every lookup, so a hash collision is
never served. The host tier hands what it evicts back to its caller, which demotes it to disk. A disk block
is one file: a msgpack header (hash, tokens, dtype, shape, CRC-32 of the payload) and the raw bytes; a file
whose header, size or checksum disagrees is deleted and reported as a miss (the tokens are recomputed).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import threading
import weakref
import zlib
from collections import OrderedDict

import msgspec
import torch

from llmserve.core.block_pool import BlockHash

DISK_MAGIC = b"LSKV1\n"
_HEADER_LEN = struct.Struct("<I")


def block_nbytes(block: torch.Tensor) -> int:
    return block.numel() * block.element_size()


class HostTier:
    """Blocks in host memory (pinned when the device is CUDA, so copies to it are DMA), least recently used
    evicted first once `capacity_bytes` would be exceeded."""

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self.blocks: OrderedDict[int, tuple[BlockHash, torch.Tensor]] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        entry = self.blocks.get(block_hash.value)
        if entry is None or entry[0] != block_hash:
            return None
        self.blocks.move_to_end(block_hash.value)
        return entry[1]

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> list[tuple[BlockHash, torch.Tensor]]:
        """Keep `block` (most recently used); returns the blocks evicted to make room (oldest first). A block
        larger than the whole budget is returned at once, not kept."""
        nbytes = block_nbytes(block)
        if nbytes > self.capacity_bytes:
            return [(block_hash, block)]
        self._drop(block_hash.value)
        evicted = []
        while self.num_bytes + nbytes > self.capacity_bytes:
            _, (old_hash, old_block) = self.blocks.popitem(last=False)
            self.num_bytes -= block_nbytes(old_block)
            evicted.append((old_hash, old_block))
        if self.pin_memory and not block.is_pinned():
            block = block.pin_memory()
        self.blocks[block_hash.value] = (block_hash, block)
        self.num_bytes += nbytes
        return evicted

    def _drop(self, value: int) -> None:
        entry = self.blocks.pop(value, None)
        if entry is not None:
            self.num_bytes -= block_nbytes(entry[1])

    def clear(self) -> None:
        self.blocks.clear()
        self.num_bytes = 0

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(block_nbytes(b) for _, b in self.blocks.values()), "host tier bytes drifted"
        assert self.num_bytes <= self.capacity_bytes, "host tier over its budget"
        assert all(h.value == v for v, (h, _) in self.blocks.items()), "host tier index differs from its hashes"


class DiskHeader(msgspec.Struct, array_like=True):
    """What a block file says about itself; checked against the lookup and the payload before use."""

    hash_value: int
    token_ids: list[int]
    dtype: str
    shape: list[int]
    num_bytes: int
    crc32: int


class DiskTier:
    """Block files in a directory of its own under `root` (made at start, removed at close: files of another
    run may hold another model's KV), least recently used deleted first once `capacity_bytes` would be
    exceeded."""

    def __init__(self, root: str, capacity_bytes: int) -> None:
        os.makedirs(root, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="llmserve-kv-", dir=root)
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.dir, True)  # also if never closed
        self.capacity_bytes = capacity_bytes
        self.files: OrderedDict[int, tuple[BlockHash, int]] = OrderedDict()  # hash value -> (hash, file bytes)
        self.num_bytes = 0
        self.num_corrupt = 0  # files found bad since the last take_corrupt

    def __len__(self) -> int:
        return len(self.files)

    def path(self, value: int) -> str:
        return os.path.join(self.dir, f"{value & 0xFFFFFFFFFFFFFFFF:016x}.kv")

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        header = DiskHeader(block_hash.value, list(block_hash.token_ids), str(block.dtype).removeprefix("torch."),
                            list(block.shape), len(payload), zlib.crc32(payload))
        head = msgspec.msgpack.encode(header)
        num_file_bytes = len(DISK_MAGIC) + _HEADER_LEN.size + len(head) + len(payload)
        if num_file_bytes > self.capacity_bytes:
            return
        self._remove(block_hash.value)
        while self.num_bytes + num_file_bytes > self.capacity_bytes:
            self._remove(next(iter(self.files)))
        with open(self.path(block_hash.value), "wb") as f:
            f.write(DISK_MAGIC + _HEADER_LEN.pack(len(head)) + head + payload)
        self.files[block_hash.value] = (block_hash, num_file_bytes)
        self.num_bytes += num_file_bytes

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block read back, or None: absent, another block's tokens, or a bad file (then deleted)."""
        if not self.has(block_hash):
            return None
        return self._accept(block_hash, self._read(block_hash))

    def has(self, block_hash: BlockHash) -> bool:
        entry = self.files.get(block_hash.value)
        return entry is not None and entry[0] == block_hash

    def read(self, block_hash: BlockHash, lock: threading.Lock) -> torch.Tensor | None:
        """`get` for a reader beside the thread that writes: the file is read outside `lock`, the index
        touched inside it. A file deleted meanwhile (evicted) is a miss; a bad one is deleted and counted."""
        block = self._read(block_hash)
        with lock:
            if not self.has(block_hash):
                return None  # evicted or replaced while it was read
            return self._accept(block_hash, block)

    def _accept(self, block_hash: BlockHash, block: torch.Tensor | None) -> torch.Tensor | None:
        """The index's side of a read: a bad file (None) deleted and counted, a good one the most recent."""
        if block is None:
            self.num_corrupt += 1
            self._remove(block_hash.value)
            return None
        self.files.move_to_end(block_hash.value)
        return block

    def _read(self, block_hash: BlockHash) -> torch.Tensor | None:
        try:
            with open(self.path(block_hash.value), "rb") as f:
                data = f.read()
            start = len(DISK_MAGIC) + _HEADER_LEN.size
            if not data.startswith(DISK_MAGIC) or len(data) < start:
                return None
            (head_len,) = _HEADER_LEN.unpack_from(data, len(DISK_MAGIC))
            header = msgspec.msgpack.decode(data[start:start + head_len], type=DiskHeader)
        except (OSError, msgspec.DecodeError, struct.error):
            return None
        payload = data[start + head_len:]
        if (header.hash_value != block_hash.value or tuple(header.token_ids) != block_hash.token_ids
                or len(payload) != header.num_bytes or zlib.crc32(payload) != header.crc32):
            return None
        dtype = getattr(torch, header.dtype)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(header.shape)

    def _remove(self, value: int) -> None:
        entry = self.files.pop(value, None)
        if entry is None:
            return
        self.num_bytes -= entry[1]
        try:
            os.remove(self.path(value))
        except FileNotFoundError:
            pass

    def take_corrupt(self) -> int:
        num, self.num_corrupt = self.num_corrupt, 0
        return num

    def clear(self) -> None:
        for value in list(self.files):
            self._remove(value)

    def close(self) -> None:
        self._remove_dir()
        self.files.clear()
        self.num_bytes = 0

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(n for _, n in self.files.values()), "disk tier bytes drifted"
        assert self.num_bytes <= self.capacity_bytes, "disk tier over its budget"
        on_disk = {name for name in os.listdir(self.dir) if name.endswith(".kv")}
        assert on_disk == {os.path.basename(self.path(v)) for v in self.files}, "disk tier files differ from its index"
