"""The KV block transfer between a prefill and a decode engine, in one process over real ZMQ sockets: the
sender reads a finished request's prompt blocks from the prefix cache, the receiver keeps them in its host
tier; every KV cache group's blocks go, each kept under its group's key; a receiver that is down costs about
a second; blocks of another layout are refused."""

import socket
import time

import pytest
import torch

from llmserve.core.block_pool import BlockPool
from llmserve.core.request import Request
from llmserve.engine.kv_transfer import KVReceiver, KVSender
from llmserve.engine.kv_wire import decode_blocks, encode_blocks
from llmserve.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from llmserve.sampling_params import KVTransferParams, SamplingParams
from llmserve.worker.kv_offload import TieredKVConnector, read_device_blocks, tier_hash
from llmserve.worker.kv_tiers import HostTier

BLOCK_SIZE = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _caches(num_blocks: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, BLOCK_SIZE, 2, 3, generator=gen) for _ in range(2)]


def _prefilled(prompt: list[int], caches) -> tuple[BlockPool, list]:
    """A pool whose blocks 1.. hold the prompt's full blocks, cached as a finished request leaves them."""
    pool = BlockPool(len(caches[0][0]), enable_caching=True)
    hashes = Request("r", prompt, SamplingParams(), [], 0.0, 1).update_block_hashes(BLOCK_SIZE)
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes):
        pool.cache_block(block, block_hash)
    pool.free(blocks)
    return pool, hashes


def _finished(request_id: str, reason: FinishReason = FinishReason.LENGTH) -> EngineCoreOutputs:
    return EngineCoreOutputs([EngineCoreOutput(request_id, [5], finish_reason=reason)])


def _request(address: str) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=1, kv_transfer_params=KVTransferParams(decode_kv_address=address))
    return EngineCoreRequest("r", list(range(10, 20)), params, [], 0.0)


def test_a_finished_requests_prompt_blocks_reach_the_decode_engines_host_tier():
    prompt = list(range(10, 20))  # 2 full blocks and 2 tokens
    src = _caches(seed=1)
    pool, hashes = _prefilled(prompt, src)
    dst = _caches(seed=2)
    connector = TieredKVConnector(dst, HostTier(1 << 20), None)
    port = _free_port()
    receiver = KVReceiver(connector, port)
    sender = KVSender(pool, src, BLOCK_SIZE)
    try:
        sender.add(_request(f"tcp://127.0.0.1:{port}"), hashes[:2])
        sender.on_outputs(_finished("r"))
        assert sender.take_num_sent() == 2 and not sender.pending
        assert connector.num_matched_blocks(hashes) == 2
        for block_hash, block_id in zip(hashes, (1, 2)):
            assert torch.equal(connector.matched[block_hash.value], read_device_blocks(src, [block_id])[0])
        assert connector.take_stats().num_received_blocks == 2
    finally:
        sender.close()
        receiver.close()


def test_every_kv_cache_groups_blocks_are_sent_while_all_of_a_position_are_cached():
    """Two groups (a full and a sliding one): the sliding group's third block was evicted, so positions 0 and
    1 go with both groups' blocks, position 2 (whole only in the full group) and later do not."""
    prompt = list(range(10, 23))  # 3 full blocks and 1 token
    src = _caches(num_blocks=8, seed=1)
    pool = BlockPool(8, enable_caching=True)
    hashes = Request("r", prompt, SamplingParams(), [], 0.0, 1).update_block_hashes(BLOCK_SIZE)
    blocks = pool.allocate(6)  # position i's group g block: blocks[2 * i + g]
    for i, block in enumerate(blocks[:5]):  # position 2's sliding block is not cached (evicted)
        pool.cache_block(block, hashes[i // 2], i % 2)
    pool.free(blocks)
    connector = TieredKVConnector(_caches(seed=2), HostTier(1 << 20), None)
    port = _free_port()
    receiver, sender = KVReceiver(connector, port, num_groups=2), KVSender(pool, src, BLOCK_SIZE, num_groups=2)
    try:
        sender.add(_request(f"tcp://127.0.0.1:{port}"), hashes[:3])
        sender.on_outputs(_finished("r"))
        assert sender.take_num_sent() == 4
        assert connector.num_matched_blocks(hashes, num_groups=2) == 2
        for i, block in enumerate(blocks[:4]):
            key = tier_hash(hashes[i // 2], i % 2)
            assert torch.equal(connector.matched[key.value], read_device_blocks(src, [block.block_id])[0])
    finally:
        sender.close()
        receiver.close()


def test_an_aborted_request_sends_nothing():
    pool, hashes = _prefilled(list(range(10, 20)), _caches())
    sender = KVSender(pool, _caches(), BLOCK_SIZE)
    sender.add(_request("tcp://127.0.0.1:1"), hashes)
    sender.on_outputs(_finished("r", FinishReason.ABORT))
    assert not sender.pending and sender.take_num_sent() == 0


def test_a_decode_engine_that_is_down_costs_about_a_second():
    caches = _caches()
    pool, hashes = _prefilled(list(range(10, 20)), caches)
    sender = KVSender(pool, caches, BLOCK_SIZE)
    sender.add(_request(f"tcp://127.0.0.1:{_free_port()}"), hashes)
    start = time.monotonic()
    sender.on_outputs(_finished("r"))
    assert time.monotonic() - start < 5 and sender.take_num_sent() == 0
    sender.close()


def test_blocks_of_another_layout_are_refused():
    caches = _caches()
    _, hashes = _prefilled(list(range(10, 20)), caches)
    frames = encode_blocks("r", hashes[:1], read_device_blocks(caches, [1]))
    with pytest.raises(ValueError, match="do not fit"):
        decode_blocks(frames, (2, 2, BLOCK_SIZE, 2, 4), torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        decode_blocks(frames, (2, 2, BLOCK_SIZE, 2, 3), torch.bfloat16)
    with pytest.raises(ValueError, match="bytes"):
        decode_blocks([frames[0], frames[1][:-4]], (2, 2, BLOCK_SIZE, 2, 3), torch.float32)
    _, blocks = decode_blocks(frames, (2, 2, BLOCK_SIZE, 2, 3), torch.float32)
    assert blocks[0][:2] == (hashes[0], 0) and torch.equal(blocks[0][2], read_device_blocks(caches, [1])[0])
    grouped = encode_blocks("r", hashes[:1], read_device_blocks(caches, [1]), groups=[1])
    with pytest.raises(ValueError, match="KV cache groups"):  # a hybrid model's blocks, to a one-group engine
        decode_blocks(grouped, (2, 2, BLOCK_SIZE, 2, 3), torch.float32)
    assert decode_blocks(grouped, (2, 2, BLOCK_SIZE, 2, 3), torch.float32, num_groups=2)[1][0][1] == 1
