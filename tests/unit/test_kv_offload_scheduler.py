"""The scheduler with a KV connector: cached blocks let go of are saved once, held until their save ends and
never handed out before; blocks the connector holds loaded into the blocks allocated after the device's
prefix hits and counted as computed (exact block ids)."""

from collections.abc import Sequence
from concurrent.futures import Future

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.block_pool import BlockHash
from llmserve.core.kv_connector import KVBlockCopy, KVConnector
from llmserve.core.scheduler import Scheduler

from core_helpers import make_request, step


class DictConnector(KVConnector):
    """Keeps the hashes of what it is asked to save; its 'data' is the block id it came from. A load ends
    when the test says (`finish`): it is held until then, as a slow disk read would be. A save ends at once,
    or, with `is_holding_saves`, when the test says (`finish_saves`)."""

    def __init__(self, is_holding_saves: bool = False) -> None:
        self.stored: dict[tuple[int, int], BlockHash] = {}  # (group, hash value) -> hash
        self.saved: list[KVBlockCopy] = []  # every save's blocks, in the order they started
        self.loads: list[tuple[list[KVBlockCopy], Future]] = []  # started, not finished
        self.saves: list[tuple[list[KVBlockCopy], Future]] = []  # likewise
        self.is_holding_saves = is_holding_saves

    def start_load(self, loads: list[KVBlockCopy]) -> Future:
        load = Future()
        self.loads.append((loads, load))
        return load

    def finish(self, num_blocks: int | None = None) -> list[KVBlockCopy]:
        """End the oldest load with `num_blocks` of its blocks arrived (all by default); its copies."""
        loads, load = self.loads.pop(0)
        load.set_result(len(loads) if num_blocks is None else num_blocks)
        return loads

    def start_save(self, saves: list[KVBlockCopy]) -> Future:
        self.saved += saves
        save = Future()
        self.saves.append((saves, save))
        if not self.is_holding_saves:
            self.finish_saves()
        return save

    def finish_saves(self) -> None:
        for saves, save in self.saves:
            for copy in saves:
                self.stored[(copy.group, copy.block_hash.value)] = copy.block_hash
            save.set_result(None)
        self.saves.clear()

    def num_matched_blocks(self, hashes: Sequence[BlockHash], num_groups: int = 1) -> int:
        for i, block_hash in enumerate(hashes):
            if any(self.stored.get((g, block_hash.value)) != block_hash for g in range(num_groups)):
                return i
        return len(hashes)

    def apply(self) -> None:
        pass

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        return not self.saves

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
        connector.apply()
        while connector.loads:
            connector.finish()
        outs.append(out)
    return outs


def test_blocks_let_go_of_are_saved_once_and_a_later_hit_is_loaded_not_computed():
    connector = DictConnector()
    sched = _scheduler(connector)  # 7 usable blocks of 4 tokens
    a = list(range(1, 13))  # 3 full blocks
    _run(sched, connector, make_request("a", a, max_tokens=1))
    assert [c.block_hash.token_ids for c in connector.saved] == [(9, 10, 11, 12), (5, 6, 7, 8), (1, 2, 3, 4)]
    _run(sched, connector, make_request("a1", a + [99], max_tokens=1))  # a's blocks hit, freed again: saved once
    assert len(connector.saved) == 3
    _run(sched, connector, make_request("b", list(range(100, 124)), max_tokens=1))  # 6 blocks: evicts 2 of a's
    assert len(connector.saved) == 3 + 6  # b's; a's evicted blocks needed no copy, theirs was made
    sched.check_integrity()
    a2 = make_request("a2", a + [13], max_tokens=1)
    sched.add_request(a2)
    out, _ = step(sched)
    assert out.is_empty and a2.status.name == "WAITING_FOR_KV"  # block 1 on the device, 2 and 3 loading
    sched.check_integrity()
    connector.apply()
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
    outs = _run(sched, connector, make_request("c", list(range(1, 14)), max_tokens=1, prompt_logprobs=1))
    assert outs[0].new_reqs[0].num_computed_tokens == 0 and not connector.loads
    sched.check_integrity()


def _evict_a(sched: Scheduler, connector: DictConnector) -> list[int]:
    """Runs a (3 full blocks, saved to the connector), then b, whose blocks evict a's last two; a's prompt."""
    a = list(range(1, 13))
    _run(sched, connector, make_request("a", a, max_tokens=1))
    _run(sched, connector, make_request("b", list(range(100, 124)), max_tokens=1))
    return a


def test_other_requests_step_while_a_load_is_held():
    connector = DictConnector()
    sched = _scheduler(connector)
    a = _evict_a(sched, connector)
    sched.add_request(make_request("c", [50, 51], max_tokens=6, ignore_eos=True))
    step(sched)  # c's prompt
    connector.apply()
    a2 = make_request("a2", a + [13], max_tokens=2)
    sched.add_request(a2)
    for _ in range(3):  # a2's load held: c decodes on
        out, update = step(sched)
        connector.apply()
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


def test_a_save_holds_its_blocks_until_the_copy_ends_and_the_steps_go_on():
    connector = DictConnector(is_holding_saves=True)
    sched = _scheduler(connector)  # 7 usable blocks of 4 tokens
    _run(sched, connector, make_request("a", list(range(1, 13)), max_tokens=1))
    held = {c.block_id for c in connector.saved}
    assert len(held) == 3 and connector.saves  # a's full blocks, their copy not done
    pool = sched.kv.pool
    assert pool.get_num_free_blocks() == 4 and not held & set(pool.free_queue.block_ids())
    sched.check_integrity()  # the save counts as their holder
    sched.add_request(make_request("c", [50, 51], max_tokens=1))
    out, _ = step(sched)  # the step does not wait for the copy
    assert out.num_scheduled_tokens == {"c": 2} and not held & set(out.new_reqs[0].block_ids)
    sched.add_request(make_request("b", list(range(100, 124)), max_tokens=1))  # 6 blocks: 4 free
    out, _ = step(sched)
    assert out.is_empty  # b waits rather than take blocks a copy still reads
    sched.check_integrity()
    connector.finish_saves()
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"b": 24} and held & set(out.new_reqs[0].block_ids)
    sched.check_integrity()


def test_blocks_short_a_running_request_waits_for_a_save_rather_than_preempt():
    connector = DictConnector(is_holding_saves=True)
    sched = _scheduler(connector, num_blocks=5)  # 4 usable blocks of 4 tokens
    long = make_request("long", [1, 2, 3], max_tokens=9, ignore_eos=True)
    sched.add_request(long)
    sched.add_request(make_request("a", list(range(10, 18)), max_tokens=1))
    step(sched)  # long: 1 block; a: 2 full blocks, finished: held by its save
    assert len(connector.saved) == 2 and sched.kv.pool.get_num_free_blocks() == 1
    a_save = connector.saves[0][1]
    release = sched.release_saved_blocks  # blocks short, the scheduler waits for the copies (else: preempts)

    def copy_ends_while_it_waits() -> bool:
        connector.finish_saves()
        return release()

    sched.release_saved_blocks = copy_ends_while_it_waits
    while sched.requests:  # long needs a third block at its 9th token: a's are the only ones left
        step(sched)
    assert a_save.done() and long.num_preemptions == 0 and len(long.output_token_ids) == 9
    sched.check_integrity()
