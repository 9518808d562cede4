"""The scheduler with a KV connector: evicted blocks listed as saves, blocks the connector holds loaded into
the blocks allocated after the device's prefix hits and counted as computed (exact block ids)."""

from collections.abc import Sequence
from concurrent.futures import Future

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.block_pool import BlockHash
from llmserve.core.kv_connector import KVBlockCopy, KVConnector, KVTransfers
from llmserve.core.scheduler import Scheduler

from core_helpers import make_request, step


class DictConnector(KVConnector):
    """Keeps the hashes of what it is asked to save; its 'data' is the block id it came from. A load ends
    when the test says (`finish`): it is held until then, as a slow disk read would be."""

    def __init__(self) -> None:
        self.stored: dict[tuple[int, int], BlockHash] = {}  # (group, hash value) -> hash
        self.applied: list[KVTransfers] = []
        self.loads: list[tuple[list[KVBlockCopy], Future]] = []  # started, not finished

    def start_load(self, loads: list[KVBlockCopy]) -> Future:
        load = Future()
        self.loads.append((loads, load))
        return load

    def finish(self, num_blocks: int | None = None) -> list[KVBlockCopy]:
        """End the oldest load with `num_blocks` of its blocks arrived (all by default); its copies."""
        loads, load = self.loads.pop(0)
        load.set_result(len(loads) if num_blocks is None else num_blocks)
        return loads

    def num_matched_blocks(self, hashes: Sequence[BlockHash], num_groups: int = 1) -> int:
        for i, block_hash in enumerate(hashes):
            if any(self.stored.get((g, block_hash.value)) != block_hash for g in range(num_groups)):
                return i
        return len(hashes)

    def apply(self, transfers: KVTransfers) -> None:
        self.applied.append(transfers)
        for copy in transfers.saves:
            self.stored[(copy.group, copy.block_hash.value)] = copy.block_hash

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
    """Steps until the request ends, each load ending at once after the step that started it."""
    sched.add_request(request)
    outs = []
    while sched.requests:
        out, _ = step(sched)
        connector.apply(out.kv_transfers)
        while connector.loads:
            connector.finish()
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
    a2 = make_request("a2", a + [13], max_tokens=1)
    sched.add_request(a2)
    out, _ = step(sched)
    assert out.is_empty and a2.status.name == "WAITING_FOR_KV"  # block 1 on the device, 2 and 3 loading
    sched.check_integrity()
    connector.apply(out.kv_transfers)
    loads = connector.finish()
    assert [c.block_hash.token_ids for c in loads] == [(5, 6, 7, 8), (9, 10, 11, 12)]
    out, _ = step(sched)
    new = out.new_reqs[0]
    assert new.num_computed_tokens == 12 and out.num_scheduled_tokens["a2"] == 1
    assert [c.block_id for c in loads] == new.block_ids[1:3]  # the loaded blocks, hit as the device's
    assert sched.kv.pool.get_cached_block(_block_hash(a, 2)).block_id == loads[1].block_id
    assert a2.num_cached_tokens == 12
    sched.check_integrity()


def test_prompt_logprobs_requests_load_nothing():
    connector = DictConnector()
    sched = _scheduler(connector)
    _run(sched, connector, make_request("a", list(range(1, 13)), max_tokens=1))
    _run(sched, connector, make_request("b", list(range(100, 124)), max_tokens=1))
    connector.applied.clear()
    outs = _run(sched, connector, make_request("c", list(range(1, 14)), max_tokens=1, prompt_logprobs=1))
    assert outs[0].new_reqs[0].num_computed_tokens == 0 and not connector.loads
    sched.check_integrity()


def _evict_a(sched: Scheduler, connector: DictConnector) -> list[int]:
    """Runs a (3 full blocks), then b, whose blocks evict a's last two to the connector; a's prompt."""
    a = list(range(1, 13))
    _run(sched, connector, make_request("a", a, max_tokens=1))
    _run(sched, connector, make_request("b", list(range(100, 124)), max_tokens=1))
    return a


def test_other_requests_step_while_a_load_is_held():
    connector = DictConnector()
    sched = _scheduler(connector)
    a = _evict_a(sched, connector)
    sched.add_request(make_request("c", [50, 51], max_tokens=6, ignore_eos=True))
    connector.apply(step(sched)[0].kv_transfers)  # c's prompt
    a2 = make_request("a2", a + [13], max_tokens=2)
    sched.add_request(a2)
    for _ in range(3):  # a2's load held: c decodes on
        out, update = step(sched)
        connector.apply(out.kv_transfers)
        assert list(out.num_scheduled_tokens) == ["c"] and a2.status.name == "WAITING_FOR_KV"
        assert update.stats.num_waiting == 1  # counted as waiting (the queue-depth metric scales on it)
        sched.check_integrity()
    assert len(connector.loads) == 1 and len(sched.requests["c"].output_token_ids) == 4
    connector.finish()
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"c": 1, "a2": 1}
    assert out.new_reqs[0].num_computed_tokens == 12
    sched.check_integrity()


def test_a_request_aborted_during_its_load_keeps_its_blocks_until_the_copy_ends():
    connector = DictConnector()
    sched = _scheduler(connector)
    a = _evict_a(sched, connector)
    sched.add_request(make_request("a2", a + [13], max_tokens=1))
    out, _ = step(sched)
    num_free = sched.kv.pool.get_num_free_blocks()
    sched.abort_requests(["a2"])
    sched.abort_requests(["a2"])  # twice: one output
    out, update = step(sched)
    assert [o.request_id for o in update.outputs] == ["a2"]
    assert sched.kv.pool.get_num_free_blocks() == num_free  # the copy may still write them
    sched.check_integrity()
    connector.finish()
    out, _ = step(sched)
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.get_num_free_blocks() == sched.kv.pool.num_usable_blocks
    assert sched.kv.pool.get_cached_block(_block_hash(a, 2)) is None  # never indexed: its KV may be half there
    sched.check_integrity()


def _block_hash(prompt: list[int], block: int) -> BlockHash:
    """The chained hash of `prompt`'s block `block` (block size 4, no salt)."""
    return make_request("probe", prompt + [0]).update_block_hashes(4)[block]


def test_a_load_that_fails_midway_computes_the_rest():
    connector = DictConnector()
    sched = _scheduler(connector)
    a = _evict_a(sched, connector)
    sched.add_request(make_request("a2", a + [13], max_tokens=1))
    step(sched)
    connector.finish(num_blocks=1)  # block 2 arrived, block 3 failed its checks
    out, _ = step(sched)
    assert out.new_reqs[0].num_computed_tokens == 8 and out.num_scheduled_tokens["a2"] == 5
    sched.check_integrity()


def test_a_load_that_raises_computes_the_rest_and_does_not_load_again():
    connector = DictConnector()
    sched = _scheduler(connector)
    a = _evict_a(sched, connector)
    sched.add_request(make_request("a2", a + [13], max_tokens=1))
    step(sched)
    _, load = connector.loads.pop(0)
    load.set_exception(OSError("disk gone"))
    out, _ = step(sched)
    assert out.new_reqs[0].num_computed_tokens == 4 and not connector.loads
    sched.check_integrity()
