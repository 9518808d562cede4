"""Requests whose prefix a KV connector is copying into device blocks (WAITING_FOR_KV, vLLM's
WAITING_FOR_REMOTE_KVS): they wait aside while the other requests keep stepping, so a disk read or a
prefill server's blocks never stall the step loop.

A load's life: the scheduler, first scheduling a request, finds the connector holding blocks past the
device's prefix hits (`try_start`); the request takes its hits and fresh blocks for those (not indexed yet:
their KV is not there) and the connector copies into them in the background. Once the copy ends
(`take_done`), the blocks that arrived are indexed as prefix-cache blocks and the request lets go of all its
blocks, as a finished one would, and goes back to the front of the queue: scheduled again, it finds them as
device prefix hits and computes only the rest. A load that fails (a corrupt disk block, an error) leaves
the rest of the prompt to compute. A request aborted during its load keeps its blocks until the copy ends
(nothing else may be given blocks the copy still writes).
"""

from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future

from llmserve.core.block_pool import KVBlock
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.kv_connector import KVBlockCopy, KVConnector
from llmserve.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class KVLoadWaitList:
    def __init__(self, kv: KVCacheManager, connector: KVConnector) -> None:
        self.kv, self.connector = kv, connector
        self.loads: dict[str, tuple[Request, int, Future[int]]] = {}  # id -> (request, device hit tokens, copy)

    def __len__(self) -> int:
        return len(self.loads)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self.loads

    def try_start(self, request: Request, hits: list[KVBlock], num_hit_tokens: int) -> bool:
        """Start loading what the connector holds past the device's hits; False (nothing done) if it holds
        nothing, the request loaded once already (its prefix was evicted again: it computes), it scores its
        prompt (prompt logprobs), or blocks are short."""
        if request.has_loaded_kv or request.sampling_params.prompt_logprobs is not None:
            return False
        block_size = self.kv.block_size
        num_max = (request.num_tokens - 1) // block_size  # at least one token is left to compute
        hashes = request.block_hashes[num_hit_tokens // block_size:num_max]
        num_matched = self.connector.num_matched_blocks(hashes, self.kv.num_groups) if hashes else 0
        if num_matched == 0:
            return False
        new_blocks = self.kv.allocate_for_load(request, hits, num_matched)
        if new_blocks is None:
            return False
        num_groups = self.kv.num_groups
        copies = [KVBlockCopy(block.block_id, hashes[i // num_groups], i % num_groups)
                  for i, block in enumerate(new_blocks)]
        request.status = RequestStatus.WAITING_FOR_KV
        request.has_loaded_kv = True
        self.loads[request.request_id] = (request, num_hit_tokens, self.connector.start_load(copies))
        return True

    def take_done(self) -> list[Request]:
        """The requests whose copy ended, in the order their loads started: each waiting again with its
        loaded blocks in the prefix cache, or one aborted meanwhile (still holding its blocks, to free)."""
        done = [entry for entry in self.loads.values() if entry[2].done()]
        for request, num_hit_tokens, load in done:
            del self.loads[request.request_id]
            if request.is_finished:
                continue
            num_positions = self._num_loaded(request, load) // self.kv.num_groups  # whose every group's arrived
            self.kv.cache_full_blocks(request, num_hit_tokens + num_positions * self.kv.block_size)
            self._mark_saved(request, num_hit_tokens // self.kv.block_size, num_positions)
            self.kv.free(request)
            request.status = RequestStatus.WAITING
        return [request for request, _, _ in done]

    def _mark_saved(self, request: Request, num_hit_positions: int, num_positions: int) -> None:
        """The loaded blocks' KV is in the connector's store already: no save when they are let go of."""
        num_groups = self.kv.num_groups
        blocks = self.kv.req_to_blocks[request.request_id]
        for block in blocks[num_hit_positions * num_groups:(num_hit_positions + num_positions) * num_groups]:
            block.is_saved = block.block_hash is not None

    @staticmethod
    def _num_loaded(request: Request, load: Future[int]) -> int:
        error = load.exception()
        if error is None:
            return load.result()
        logger.error("request %s: loading its prefix failed, computing it: %r", request.request_id, error)
        return 0

    def wait(self, timeout: float) -> None:
        """Block until one copy ends or `timeout` seconds pass (an engine with nothing else to do)."""
        if self.loads:
            concurrent.futures.wait([load for _, _, load in self.loads.values()], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def check_integrity(self) -> None:
        for req_id, (request, _, _) in self.loads.items():
            assert request.status == RequestStatus.WAITING_FOR_KV or request.is_finished, \
                f"request {req_id} loads its prefix but is {request.status.name}"
            assert req_id in self.kv.req_to_blocks, f"request {req_id} loads into blocks it does not hold"
