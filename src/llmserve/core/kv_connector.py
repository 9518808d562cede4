"""The KV connector: where KV blocks live beyond the device's cache, keyed by block hash.

The scheduler asks it, when it first schedules a request, how many blocks past the device's prefix hits it
holds (`num_matched_blocks`); it allocates device blocks for them, counts their tokens as computed, and
lists them as loads in the step's `KVTransfers`. Blocks the prefix cache evicts while scheduling are listed
as saves. The engine core has the connector `apply` the step's transfers after scheduling and before the
forward: saves first (the evicted blocks are copied out before anything overwrites them), then loads.
Block-hash keyed (BlockHash: chained hash + the block's token ids), so a connector composes with prefix
caching: what it holds is exactly what the device's prefix cache would have held.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmserve.core.block_pool import BlockHash
from llmserve.messages import KVTierStats


@dataclass(frozen=True, slots=True)
class KVBlockCopy:
    """One block's KV copied between a device block and the connector's store."""

    block_id: int
    block_hash: BlockHash


@dataclass
class KVTransfers:
    """One step's copies. saves: device -> store (evicted from the prefix cache by this step's allocations);
    loads: store -> device (matched by `num_matched_blocks`, into blocks this step allocated)."""

    saves: list[KVBlockCopy] = field(default_factory=list)
    loads: list[KVBlockCopy] = field(default_factory=list)


class KVConnector(abc.ABC):
    """Contract: a hash that `num_matched_blocks` counted stays loadable until the next `apply` (the
    connector holds the block's data aside), so a load listed in the same step never misses."""

    @abc.abstractmethod
    def num_matched_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first on, the store holds (tokens compared, not just values)."""

    @abc.abstractmethod
    def apply(self, transfers: KVTransfers) -> None:
        """Copy the step's saves out of the device cache, then its loads into it; drop held-aside data."""

    @abc.abstractmethod
    def take_stats(self) -> KVTierStats | None:
        """Counts since the last call (None when nothing happened)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every stored block (the prefix cache was reset: the weights may have changed)."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Assert the store's bookkeeping (bytes held within budget, index and data agree)."""
