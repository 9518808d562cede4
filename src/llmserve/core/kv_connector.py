"""The KV connector: where KV blocks live beyond the device's cache, keyed by block hash.

The scheduler asks it, when it first schedules a request, how many blocks past the device's prefix hits it
holds (`num_matched_blocks`); it allocates device blocks for them and has the connector `start_load` them in
the background, while the request waits aside (WAITING_FOR_KV, core/kv_loading.py) and other requests keep
stepping. A cached block whose last holder lets go of it is saved (`start_save`), in the background too,
while the scheduler holds it so that nothing overwrites it before the copy ends (core/kv_saving.py). The
engine core calls `apply` once a step is scheduled: the step's loads start then.
Block-hash keyed (BlockHash: chained hash + the block's token ids), so a connector composes with prefix
caching: what it holds is exactly what the device's prefix cache would have held.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from llmserve.core.block_pool import BlockHash
from llmserve.messages import KVTierStats


@dataclass(frozen=True, slots=True)
class KVBlockCopy:
    """One block's KV copied between a device block and the connector's store (of KV cache group `group`:
    each group's block of one token range is stored apart, core/kv_cache_groups.py)."""

    block_id: int
    block_hash: BlockHash
    group: int = 0


class KVConnector(abc.ABC):
    """Contract: a hash that `num_matched_blocks` counted stays held aside until the next `apply` (the
    connector keeps the block's data or its file's name), so `start_load` in the same step finds it."""

    @abc.abstractmethod
    def num_matched_blocks(self, hashes: Sequence[BlockHash], num_groups: int = 1) -> int:
        """How many of `hashes`, from the first on, the store holds the block of for every one of the
        `num_groups` KV cache groups (tokens compared, not just values)."""

    @abc.abstractmethod
    def start_load(self, loads: list[KVBlockCopy]) -> Future[int]:
        """Copy matched blocks (a chain, in order) into their device blocks in the background. The future
        gives how many of them, from the first, arrived (fewer: a block failed its checks; the rest are
        recomputed); once it is done the device blocks hold their KV and nothing writes them any more."""

    @abc.abstractmethod
    def start_save(self, saves: list[KVBlockCopy]) -> Future[None]:
        """Copy these device blocks (cached: their KV is final) out to the store in the background, in order,
        starting at once. The future is done once they are read: until then the caller keeps the device
        blocks from reuse."""

    @abc.abstractmethod
    def wait_for_saves(self, timeout: float | None = None) -> bool:
        """Block until every save started so far is in the store (or `timeout` seconds pass); whether all are.
        The engine counts saves on their way as work: it goes idle (and checks its books) once they are in."""

    @abc.abstractmethod
    def apply(self) -> None:
        """The step is scheduled: start its loads; let go of held-aside blocks no load took."""

    @abc.abstractmethod
    def take_stats(self) -> KVTierStats | None:
        """Counts since the last call (None when nothing happened)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every stored block (the prefix cache was reset: the weights may have changed)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Assert the store's bookkeeping (bytes held within budget, index and data agree)."""
