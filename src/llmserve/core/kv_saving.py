"""Blocks whose KV a connector is copying out to its store (vLLM's offloading connector's stores): the saves
run in the background, so the step loop never waits for a copy to host memory or a disk write.

A cached block is saved once, when its last holder lets go of it (a request finishing, preempted, or a
sliding window moving past it): instead of going back to the pool, the save takes over that holder's
reference, so the block cannot be handed out (and overwritten) while the copy reads it; a prefix hit may
still share it meanwhile (it only reads). Once the connector has read the block, the save lets go and the
block joins the free queue, its hash kept: evicting it later needs no copy, its KV is in the store already
(`is_saved`, cleared when the block is evicted and reused).
"""

from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future

from llmserve.core.block_pool import BlockPool, KVBlock
from llmserve.core.kv_connector import KVBlockCopy, KVConnector

logger = logging.getLogger(__name__)
SAVE_WAIT_S = 1.0  # blocks short: how long to wait for a save holding blocks before preempting a request


class KVSaves:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.new: list[KVBlock] = []  # let go of since the last `start`: held, their copy not started
        self.in_flight: list[tuple[list[KVBlock], Future[None]]] = []  # in start order

    @property
    def num_held(self) -> int:
        return len(self.new) + sum(len(blocks) for blocks, _ in self.in_flight)

    def hold(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """Of blocks whose holders let go (one reference each), keep those to save (cached, not saved yet, this
        their last reference); the others, to free."""
        to_free = []
        for block in blocks:
            if block.ref_cnt == 1 and block.block_hash is not None and not block.is_saved:
                block.is_saved = True
                self.new.append(block)
            else:
                to_free.append(block)
        return to_free

    def start(self, connector: KVConnector) -> None:
        """Have the connector copy the blocks let go of since the last call (in that order)."""
        if not self.new:
            return
        copies = [KVBlockCopy(block.block_id, block.block_hash, block.group) for block in self.new]
        self.in_flight.append((self.new, connector.start_save(copies)))
        self.new = []

    def drain(self) -> None:
        """Let go of every held block: those not started without a copy, the others once theirs ended
        (the prefix cache is being reset: nothing of it is kept)."""
        for block in self.new:
            block.is_saved = False
        self.pool.free(self.new)
        self.new = []
        while self.in_flight:
            self.release_done(wait_s=1.0)

    def release_done(self, wait_s: float = 0.0) -> int:
        """Let go of the blocks whose copy ended (waiting up to `wait_s` for the oldest first); how many."""
        if wait_s > 0 and self.in_flight:
            concurrent.futures.wait([self.in_flight[0][1]], wait_s)
        num_released = 0
        for entry in [e for e in self.in_flight if e[1].done()]:
            self.in_flight.remove(entry)
            blocks, save = entry
            if save.exception() is not None:  # the blocks are recomputed when needed: nothing is lost but time
                logger.error("saving %d KV blocks failed: %r", len(blocks), save.exception())
                for block in blocks:
                    block.is_saved = False  # let go of again, they are saved again
            self.pool.free(blocks)
            num_released += len(blocks)
        return num_released

    def wait_to_release(self, connector: KVConnector) -> int:
        """Blocks ran short: start what is not started and wait (up to SAVE_WAIT_S) for the oldest copy to end;
        the blocks let go of."""
        if not self.num_held:
            return 0
        self.start(connector)
        return self.release_done(wait_s=SAVE_WAIT_S)

    def wait(self, timeout: float) -> bool:
        """Block until one copy ends or `timeout` seconds pass (an engine with nothing else to do); False (at
        once) when none is under way."""
        if not self.in_flight:
            return False
        concurrent.futures.wait([save for _, save in self.in_flight], timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        return True

    def held_blocks(self) -> list[KVBlock]:
        return self.new + [block for blocks, _ in self.in_flight for block in blocks]

    def check_integrity(self) -> None:
        """Every held block is cached and marked saved, and held once (the manager counts it as an owner)."""
        held = self.held_blocks()
        assert len({b.block_id for b in held}) == len(held), "a block is held by two saves"
        for block in held:
            assert block.block_hash is not None and block.is_saved, \
                f"block {block.block_id} held for a save lost its KV"
            assert block.ref_cnt >= 1, f"block {block.block_id} held for a save is free"
