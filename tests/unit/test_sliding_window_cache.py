"""The KV cache of a model whose every layer slides: blocks wholly before the window go back to the pool
(exact ids, as vLLM's core tests check them), a prefix hit needs only the window's blocks, nothing leaks
through preemption and aborts, and the same pool admits several times the long sequences."""

from __future__ import annotations

import pytest

from llmserve.core.kv_cache_groups import single_group_layout
from llmserve.core.kv_cache_manager import KVCacheManager

from core_helpers import advance, ids, make_request, make_scheduler, run_with_an_abort, step


def test_blocks_before_the_window_go_back_as_tokens_advance():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False, group_windows=(6,))
    request = make_request("a", list(range(1, 9)), max_tokens=20)
    advance(kv, request, 8)  # a query at position p reads keys p-5..p
    assert ids(kv, request) == [1, 2]
    advance(kv, request, 1)  # computes token 8: reads 3..8, block 0 (tokens 0..3) still read
    assert ids(kv, request) == [1, 2, 3]
    advance(kv, request, 1)  # token 9 reads 4..9: block 1 goes back
    assert ids(kv, request) == [0, 2, 3]
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 1]
    for _ in range(3):
        advance(kv, request, 1)
    assert ids(kv, request) == [0, 2, 3, 4]  # token 12 (block 3) reads 7..12
    advance(kv, request, 1)
    assert ids(kv, request) == [0, 0, 3, 4]  # token 13 reads 8..13: block 2 goes back
    assert kv.num_held_blocks("a") == 2
    kv.check_integrity()
    kv.free(request)
    assert kv.pool.get_num_free_blocks() == 9
    kv.check_integrity()


def test_a_hit_needs_only_the_window_blocks_before_it():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=True, group_windows=(6,))
    first = make_request("a", list(range(1, 17)), max_tokens=4)
    for _ in range(4):  # four chunks of 4: block 1 goes back (cached) before the last one
        advance(kv, first, 4)
    assert ids(kv, first) == [0, 2, 3, 4]
    other = make_request("b", [99, 98, 97, 96])
    advance(kv, other, 4)  # takes block 1: the first block of the prefix is evicted
    assert ids(kv, other) == [1]
    kv.free(first)
    again = make_request("c", list(range(1, 17)) + [50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(again)
    assert [b.block_id for b in hits] == [0, 0, 3, 4] and num_hit == 16  # full attention: no hit at all
    assert kv.allocate_slots(again, 3, hits) is not None
    assert ids(kv, again) == [0, 0, 3, 4, 2]
    kv.check_integrity()


def test_a_hit_from_the_start_shorter_than_the_window():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, group_windows=(12,))
    first = make_request("a", list(range(1, 10)))
    advance(kv, first, 9)
    kv.free(first)
    hits, num_hit = kv.get_computed_blocks(make_request("b", list(range(1, 10)) + [70]))
    assert [b.block_id for b in hits] == [1, 2] and num_hit == 8


def test_one_group_slides_only_where_every_layer_slides():
    def window(layer_windows):
        return single_group_layout(layer_windows).group_windows

    assert window([8, 8]) == (8,) and window([8, 16]) == (16,)
    assert window([0, 8]) == (0,) and window([0, 0]) == (0,) and window([]) == (0,)


@pytest.mark.parametrize("caching", [False, True])
def test_nothing_leaks_through_preemption_and_aborts(caching):
    sched = make_scheduler(num_blocks=9, block_size=4, budget=32, caching=caching, group_windows=(14,))
    shared = list(range(1, 25))
    requests = [make_request(f"r{i}", shared[:2 + i] if i % 2 else [200 + i] * (3 + i), max_tokens=30)
                for i in range(6)]
    run_with_an_abort(sched, requests, abort_at=9, abort_id="r3")


def peak_long_sequences(num_blocks: int, window: int, context: int, block_size: int = 16) -> int:
    """The most requests that decode at once past a `context`-token prompt, from one pool of num_blocks."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=context, max_num_seqs=256,
                           caching=False, max_model_len=context + 64, group_windows=(window,))
    for i in range(64):
        sched.add_request(make_request(f"r{i}", [1 + i % 50] * context, max_tokens=128, ignore_eos=True))
    peak = 0
    while sched.has_unfinished_requests():
        step(sched)
        peak = max(peak, sum(r.num_computed_tokens >= context for r in sched.running))
    sched.check_integrity()
    return peak


@pytest.mark.parametrize("window,context", [(64, 512), (4096, 32768)])
def test_a_sliding_window_admits_several_times_the_long_sequences(window, context):
    num_blocks = 4 * context // 16 + 1  # four sequences of full attention
    full, sliding = peak_long_sequences(num_blocks, 0, context), peak_long_sequences(num_blocks, window, context)
    print(f"window {window} of {context}: {full} sequences at once with full attention, {sliding} sliding")
    assert full <= 4 and sliding >= 4 * full
