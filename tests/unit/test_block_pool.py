import pytest

from llmserve.core.block_pool import BlockHash, BlockPool, FreeBlockQueue, KVBlock


def test_free_queue_remove_from_middle_is_linked():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 2]
    assert queue.num_free_blocks == 4


def test_null_block_is_never_allocated():
    pool = BlockPool(4, enable_caching=True)
    got = pool.allocate(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert pool.get_num_free_blocks() == 0
    pool.check_integrity()


def test_free_appends_in_given_order_and_ref_counts():
    pool = BlockPool(5, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.touch([b])  # shared
    pool.free([c, b, a])
    assert pool.free_queue.block_ids() == [4, 3, 1]  # b still referenced
    assert b.ref_cnt == 1
    pool.free([b])
    assert pool.free_queue.block_ids() == [4, 3, 1, 2]
    pool.check_integrity()


def test_cached_block_is_revived_and_evicted_on_reuse():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    h = BlockHash(123, (1, 2))
    pool.cache_block(a, h)
    pool.free([a, b])
    assert pool.get_cached_block(h) is a
    pool.touch([a])  # revived from the middle of the free queue
    assert a.ref_cnt == 1 and pool.free_queue.block_ids() == [2]
    pool.free([a])
    got = pool.allocate(2)  # b (id 2) first, then a: a's hash is evicted
    assert [x.block_id for x in got] == [2, 1]
    assert pool.get_cached_block(h) is None and a.block_hash is None
    pool.check_integrity()


def test_hash_collision_is_not_served():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache_block(a, BlockHash(99, (1, 2, 3)))
    assert pool.get_cached_block(BlockHash(99, (4, 5, 6))) is None
    assert pool.get_cached_block(BlockHash(99, (1, 2, 3))) is a


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache_block(a, BlockHash(1, (1,)))
    assert not pool.reset_prefix_cache()
    pool.free([a])
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and a.block_hash is None


def test_double_free_is_caught():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(AssertionError):
        pool.free([a])
