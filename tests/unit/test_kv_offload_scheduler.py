"""The scheduler with a KV connector: evicted blocks listed as saves, blocks the connector holds loaded into
the blocks allocated after the device's prefix hits and counted as computed (exact block ids)."""

from collections.abc import Sequence

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.block_pool import BlockHash
from llmserve.core.kv_connector import KVConnector, KVTransfers
from llmserve.core.scheduler import Scheduler

from core_helpers import make_request, step


class DictConnector(KVConnector):
    """Keeps the hashes of what it is asked to save; its 'data' is the block id it came from."""

    def __init__(self) -> None:
        self.stored: dict[int, BlockHash] = {}
        self.applied: list[KVTransfers] = []

    def num_matched_blocks(self, hashes: Sequence[BlockHash]) -> int:
        for i, block_hash in enumerate(hashes):
            if self.stored.get(block_hash.value) != block_hash:
                return i
        return len(hashes)

    def apply(self, transfers: KVTransfers) -> None:
        self.applied.append(transfers)
        for copy in transfers.saves:
            self.stored[copy.block_hash.value] = copy.block_hash

    def take_stats(self):
        return None

    def reset(self) -> None:
        self.stored.clear()

    def check_integrity(self) -> None:
        pass


def _scheduler(connector: KVConnector, num_blocks: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), CacheConfig(block_size=4),
                     num_blocks, 64, kv_connector=connector)


def _run(sched: Scheduler, connector: DictConnector, request) -> list:
    sched.add_request(request)
    outs = []
    while sched.requests:
        out, _ = step(sched)
        connector.apply(out.kv_transfers)
        outs.append(out)
    return outs


def test_evicted_blocks_are_saved_and_a_later_hit_is_loaded_not_computed():
    connector = DictConnector()
    sched = _scheduler(connector)  # 7 usable blocks of 4 tokens
    a = list(range(1, 13))  # 3 full blocks
    _run(sched, connector, make_request("a", a, max_tokens=1))
    assert connector.applied[0].saves == []
    _run(sched, connector, make_request("b", list(range(100, 124)), max_tokens=1))  # 6 blocks: evicts 2 of a's
    saved = [c.block_hash.token_ids for t in connector.applied for c in t.saves]
    assert saved == [(9, 10, 11, 12), (5, 6, 7, 8)]  # tail first
    sched.check_integrity()
    connector.applied.clear()
    outs = _run(sched, connector, make_request("a2", a + [13], max_tokens=1))
    first = outs[0]
    new = first.new_reqs[0]
    assert new.num_computed_tokens == 12  # block 1 on the device, blocks 2 and 3 loaded
    assert first.num_scheduled_tokens["a2"] == 1
    loads = connector.applied[0].loads
    assert [c.block_hash.token_ids for c in loads] == [(5, 6, 7, 8), (9, 10, 11, 12)]
    assert [c.block_id for c in loads] == new.block_ids[1:3]
    sched.check_integrity()


def test_prompt_logprobs_requests_load_nothing():
    connector = DictConnector()
    sched = _scheduler(connector)
    _run(sched, connector, make_request("a", list(range(1, 13)), max_tokens=1))
    _run(sched, connector, make_request("b", list(range(100, 124)), max_tokens=1))
    connector.applied.clear()
    outs = _run(sched, connector, make_request("c", list(range(1, 14)), max_tokens=1, prompt_logprobs=1))
    assert outs[0].new_reqs[0].num_computed_tokens == 0 and connector.applied[0].loads == []
    sched.check_integrity()
