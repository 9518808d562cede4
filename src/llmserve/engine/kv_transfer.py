"""The engine core's KV connector and, for prefill/decode disaggregation, its two transports.

A prefill server (--disaggregation-mode prefill) runs a request that names a decode server's KV address
(`kv_transfer_params.decode_kv_address`) as any other; when it finishes, the KVSender copies the request's
full prompt blocks (every KV cache group's) out of the device's prefix cache (still there: nothing is
allocated between the step that finished it and the next schedule) and sends them to that address over ZMQ,
waiting for the ack before the request's output leaves the engine, so the router forwards to the decode
server only once its blocks are there. The decode server's KVReceiver thread keeps them in its host tier (worker/kv_offload.py),
where the decode request's prefix lookup finds them: it loads them and computes only the prompt's tail
(the tokens of its last, partial block, at least one), which samples the first token again.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import torch
import zmq

from llmserve.config import KVTransferConfig
from llmserve.core.block_pool import BlockHash, BlockPool
from llmserve.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from llmserve.engine.kv_wire import KVTransferAck, decode_blocks, encode_blocks
from llmserve.worker.kv_offload import TieredKVConnector, read_device_blocks, tier_hash
from llmserve.worker.kv_tiers import DiskTier, HostTier

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_MS = 1_000  # a decode server not connected by then is given up (it recomputes the prompt)
ACK_TIMEOUT_MS = 30_000  # likewise one that does not ack a transfer by then
RECEIVER_POLL_MS = 500


def build_kv_connector(config: KVTransferConfig, kv_caches: list[torch.Tensor]) -> TieredKVConnector | None:
    """The tiers the flags ask for over this engine's cache, or None without any."""
    if not config.is_offloading:
        return None
    host_bytes = config.host_tier_bytes()
    is_cuda = kv_caches[0].device.type == "cuda"
    host = HostTier(host_bytes, pin_memory=is_cuda) if host_bytes else None
    disk = DiskTier(config.kv_offload_disk, config.disk_tier_bytes()) if config.kv_offload_disk else None
    return TieredKVConnector(kv_caches, host, disk)


def block_layout(kv_caches: list[torch.Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
    """One block's host shape [num_layers, 2, block_size, Hkv, D] and dtype."""
    _, _, block_size, num_kv_heads, head_dim = kv_caches[0].shape
    return (len(kv_caches), 2, block_size, num_kv_heads, head_dim), kv_caches[0].dtype


class KVSender:
    """Prefill side: the prompt blocks of finished requests to the decode server each one names."""

    def __init__(self, pool: BlockPool, kv_caches: list[torch.Tensor], block_size: int, num_groups: int = 1) -> None:
        """num_groups: the KV cache groups (core/kv_cache_groups.py): every group's blocks are sent."""
        self.pool, self.kv_caches, self.block_size, self.num_groups = pool, kv_caches, block_size, num_groups
        self.ctx = zmq.Context.instance()
        self.sockets: dict[str, zmq.Socket] = {}
        self.pending: dict[str, tuple[str, list[BlockHash]]] = {}  # request id -> (address, prompt hashes)
        self.num_sent_blocks = 0

    def add(self, request: EngineCoreRequest, hashes: list[BlockHash]) -> None:
        params = request.sampling_params.kv_transfer_params
        if params is not None:
            self.pending[request.request_id] = (params.decode_kv_address, hashes)

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            if out.finish_reason is None or out.request_id not in self.pending:
                continue
            address, hashes = self.pending.pop(out.request_id)
            if out.finish_reason != FinishReason.ABORT:
                self._send(out.request_id, address, hashes)

    def _send(self, request_id: str, address: str, hashes: list[BlockHash]) -> None:
        found = self._cached_blocks(hashes)
        if not found:
            return
        blocks = read_device_blocks(self.kv_caches, [block_id for _, _, block_id in found])
        frames = encode_blocks(request_id, [h for h, _, _ in found], blocks, [g for _, g, _ in found])
        ack = self._exchange(address, frames)
        if ack is None or ack.error is not None:
            logger.warning("request %s: %s took no KV blocks (%s): it computes the prompt itself", request_id,
                           address, "no answer" if ack is None else ack.error)
            return
        self.num_sent_blocks += ack.num_blocks

    def _cached_blocks(self, hashes: list[BlockHash]) -> list[tuple[BlockHash, int, int]]:
        """(hash, group, block id) of the prompt's blocks, every group's, from the first block position on while
        every group's block of it is still cached (a sliding group's early blocks left its window but stay
        cached until evicted); the decode server loads a position only with all its groups' blocks."""
        found = []
        for block_hash in hashes:
            blocks = [self.pool.get_cached_block(block_hash, group) for group in range(self.num_groups)]
            if None in blocks:
                break
            found += [(block_hash, group, block.block_id) for group, block in enumerate(blocks)]
        return found

    def _exchange(self, address: str, frames: list[bytes]) -> KVTransferAck | None:
        """Send and wait for the ack; a socket left without one is closed (a REQ socket cannot send again).
        IMMEDIATE: the socket is writable only once connected, so a decode server that is down costs the
        step loop CONNECT_TIMEOUT_MS, not the ack's timeout."""
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.sockets[address] = self.ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(address)
        try:
            if sock.poll(CONNECT_TIMEOUT_MS, zmq.POLLOUT):
                sock.send_multipart(frames, copy=False)
                if sock.poll(ACK_TIMEOUT_MS, zmq.POLLIN):
                    return msgspec.msgpack.decode(sock.recv(), type=KVTransferAck)
        except (zmq.ZMQError, msgspec.DecodeError) as e:
            logger.warning("KV transfer to %s failed: %s", address, e)
        sock.close()
        del self.sockets[address]
        return None

    def take_num_sent(self) -> int:
        num, self.num_sent_blocks = self.num_sent_blocks, 0
        return num

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()


class KVReceiver:
    """Decode side: a thread that keeps the blocks prefill servers send in the connector's host tier."""

    def __init__(self, connector: TieredKVConnector, port: int, num_groups: int = 1) -> None:
        self.connector, self.num_groups = connector, num_groups
        self.block_shape, self.dtype = block_layout(connector.kv_caches)
        self.sock = zmq.Context.instance().socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://*:{port}")  # before the engine reports ready: a prefill may send at once
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])  # port 0: the one bound
        self.is_stopping = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="kv-receiver")
        self.thread.start()

    def _loop(self) -> None:
        while not self.is_stopping:
            if not self.sock.poll(RECEIVER_POLL_MS, zmq.POLLIN):
                continue
            frames = self.sock.recv_multipart()
            self.sock.send(msgspec.msgpack.encode(self._keep(frames)))
        self.sock.close()

    def _keep(self, frames: list[bytes]) -> KVTransferAck:
        try:
            header, blocks = decode_blocks(frames, self.block_shape, self.dtype, self.num_groups)
        except (ValueError, msgspec.DecodeError) as e:
            logger.warning("refused a KV transfer: %s", e)
            return KVTransferAck(0, str(e))
        for block_hash, group, block in blocks:
            self.connector.receive(tier_hash(block_hash, group), block.clone())
        logger.debug("request %s: kept %d KV blocks", header.request_id, len(blocks))
        return KVTransferAck(len(blocks))

    def close(self) -> None:
        self.is_stopping = True
        self.thread.join(timeout=2)
