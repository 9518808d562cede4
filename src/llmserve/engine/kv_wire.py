"""The wire format of a KV block transfer between a prefill server and a decode server (ZMQ, two frames):
a msgpack header naming the blocks (chained hash values and their token ids) and their layout, then the
blocks' raw bytes, back to back. The receiver answers with a KVTransferAck."""

from __future__ import annotations

import math

import msgspec
import torch

from llmserve.core.block_pool import BlockHash


class KVBlocksHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    request_id: str
    hash_values: list[int]  # the prefix cache's chained hash of each block's tokens
    groups: list[int]  # each block's KV cache group (core/kv_cache_groups.py; 0 for most models)
    token_ids: list[list[int]]  # per block
    dtype: str  # torch dtype name, e.g. "bfloat16"
    block_shape: list[int]  # [num_layers, 2, block_size, Hkv, D]


class KVTransferAck(msgspec.Struct, array_like=True):
    num_blocks: int  # blocks kept; 0 with an error
    error: str | None = None


def encode_blocks(request_id: str, hashes: list[BlockHash], blocks: list[torch.Tensor],
                  groups: list[int] | None = None) -> list[bytes]:
    """The two frames of `blocks` (host tensors [num_layers, 2, block_size, Hkv, D] each) of `groups`
    (default: every block group 0's)."""
    groups = [0] * len(blocks) if groups is None else groups
    assert blocks and len(hashes) == len(blocks) == len(groups), "one hash and group a block, at least one block"
    header = KVBlocksHeader(request_id, [h.value for h in hashes], groups, [list(h.token_ids) for h in hashes],
                            str(blocks[0].dtype).removeprefix("torch."), list(blocks[0].shape))
    payload = b"".join(block.contiguous().view(torch.uint8).numpy().tobytes() for block in blocks)
    return [msgspec.msgpack.encode(header), payload]


def decode_blocks(frames: list[bytes], block_shape: tuple[int, ...], dtype: torch.dtype,
                  num_groups: int = 1) -> tuple[KVBlocksHeader, list[tuple[BlockHash, int, torch.Tensor]]]:
    """The header and (hash, group, block) of each block of a transfer; ValueError when it does not fit this
    engine's cache (another model's layout, dtype or KV cache groups) or its bytes do not add up."""
    if len(frames) != 2:
        raise ValueError(f"a KV transfer has 2 frames, got {len(frames)}")
    header = msgspec.msgpack.decode(frames[0], type=KVBlocksHeader)
    if tuple(header.block_shape) != tuple(block_shape) or header.dtype != str(dtype).removeprefix("torch."):
        raise ValueError(f"KV blocks of shape {header.block_shape} {header.dtype} do not fit this engine's "
                         f"{list(block_shape)} {dtype}: the two servers must serve the same model and cache dtype")
    num_blocks = len(header.hash_values)
    if len(header.token_ids) != num_blocks or any(len(t) != block_shape[2] for t in header.token_ids):
        raise ValueError("a KV transfer's token ids do not match its blocks")
    if len(header.groups) != num_blocks or any(not 0 <= g < num_groups for g in header.groups):
        raise ValueError(f"a KV transfer's blocks name KV cache groups {sorted(set(header.groups))}, but this "
                         f"engine's cache has {num_groups}: the two servers must serve the same model")
    block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
    if len(frames[1]) != num_blocks * block_bytes:
        raise ValueError(f"a KV transfer of {num_blocks} blocks carries {len(frames[1])} bytes, "
                         f"not {num_blocks * block_bytes}")
    data = torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8).view(dtype).reshape(num_blocks, *block_shape)
    hashes = [BlockHash(v, tuple(t)) for v, t in zip(header.hash_values, header.token_ids)]
    return header, list(zip(hashes, header.groups, data))
