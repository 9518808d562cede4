"""Prefix caching in the vLLM style: exact block ids, free-queue order, eviction, ref counts."""

from llmserve.core.block_pool import BlockHash
from llmserve.core.kv_cache_manager import KVCacheManager

from core_helpers import make_request, make_scheduler, step


def _alloc(kv: KVCacheManager, request, num_tokens: int | None = None):
    hits, num_hit = kv.get_computed_blocks(request)
    n = (num_tokens or request.num_tokens) - num_hit
    assert kv.allocate_slots(request, n, hits) is not None
    request.num_computed_tokens = num_hit + n
    return [b.block_id for b in hits], num_hit


def test_shared_prefix_reuses_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", list(range(1, 11)))  # 10 tokens: 2 full blocks + 2
    assert _alloc(kv, a) == ([], 0)
    assert kv.get_block_ids("a") == [1, 2, 3]
    b = make_request("b", list(range(1, 9)) + [50, 51, 52])  # same first 2 blocks
    assert _alloc(kv, b) == ([1, 2], 8)
    assert kv.get_block_ids("b") == [1, 2, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    kv.check_integrity()


def test_at_least_one_token_is_computed_on_a_full_hit():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", list(range(1, 9)))  # exactly 2 blocks
    _alloc(kv, a)
    kv.free(a)
    b = make_request("b", list(range(1, 9)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [1] and num_hit == 4


def test_free_order_and_lru_eviction_tail_first():
    kv = KVCacheManager(num_blocks=7, block_size=4, enable_caching=True)
    a = make_request("a", list(range(1, 13)))  # 3 full blocks: 1, 2, 3
    _alloc(kv, a)
    kv.free(a)
    # tail first: 3, 2, 1 join after the never-used 4, 5, 6
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 3, 2, 1]
    c = make_request("c", list(range(100, 120)))  # 5 blocks: 4, 5, 6, then evicts 3, then 2
    _alloc(kv, c)
    assert kv.get_block_ids("c") == [4, 5, 6, 3, 2]
    d = make_request("d", list(range(1, 13)))
    hits, _ = kv.get_computed_blocks(d)
    assert [x.block_id for x in hits] == [1]  # the chain's head survived, its tail was evicted
    kv.check_integrity()


def test_forced_hash_collision_is_not_served(monkeypatch):
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    _alloc(kv, a)
    b = make_request("b", [9, 9, 9, 9, 5])
    # Same hash value as a's first block, different tokens.
    b.block_hashes = [BlockHash(a.block_hashes[0].value, (9, 9, 9, 9))]
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == [] and num_hit == 0


def test_decode_blocks_of_finished_request_are_hit_by_next_turn():
    sched = make_scheduler(block_size=4, budget=64)
    sched.add_request(make_request("turn1", [1, 2, 3, 4, 5, 6], max_tokens=6))
    for _ in range(7):
        step(sched, token=8)
    assert not sched.requests
    # Turn 2 resends the prompt + the answer (1..6, 8 x6) + new tokens.
    sched.add_request(make_request("turn2", [1, 2, 3, 4, 5, 6] + [8] * 6 + [30, 31], max_tokens=1))
    out = sched.schedule()
    assert out.new_reqs[0].num_computed_tokens == 8  # blocks [1..4], [5,6,8,8]; the 3rd was never full
    sched.check_integrity()


def test_prefix_stats_count_tokens():
    sched = make_scheduler(block_size=4, budget=64)
    sched.add_request(make_request("a", list(range(1, 10)), max_tokens=1))
    step(sched)
    sched.add_request(make_request("b", list(range(1, 10)), max_tokens=1))
    _, res = step(sched)
    assert (res.stats.prefix_cache_queries, res.stats.prefix_cache_hits) == (9, 8)


def test_n_siblings_wait_for_first_prefill_then_share_blocks():
    sched = make_scheduler(block_size=4, budget=64)
    prompt = list(range(1, 11))
    for i in range(3):
        sched.add_request(make_request(f"p#{i}", prompt, max_tokens=5, parent_id="p"))
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["p#0"]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"p#0": 1, "p#1": 2, "p#2": 2}
    blocks = {r.req_id: r.block_ids for r in out.new_reqs}
    assert blocks["p#1"][:2] == blocks["p#2"][:2] == sched.kv.get_block_ids("p#0")[:2]
    sched.check_integrity()


def test_caching_off_never_hits():
    sched = make_scheduler(block_size=4, budget=64, caching=False)
    sched.add_request(make_request("a", list(range(1, 10)), max_tokens=1))
    step(sched)
    sched.add_request(make_request("b", list(range(1, 10)), max_tokens=1))
    out, _ = step(sched)
    assert out.new_reqs[0].num_computed_tokens == 0
