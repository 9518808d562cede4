"""The engine freezes its start-up heap out of the cyclic collector's passes (llmserve/heap.py):
that is safe only while a dropped engine is freed by reference counting alone, i.e. holds no reference
cycles (a frozen cycle is never collected)."""

from __future__ import annotations

import gc
import weakref

from llmserve.config import CacheConfig, EngineConfig, ModelConfig
from llmserve.core.block_pool import BlockPool, KVBlock
from llmserve.engine.engine_core import EngineCore
from llmserve.messages import EngineCoreRequest
from llmserve.testing.maker import make_model
from llmserve.sampling_params import SamplingParams


def test_a_dropped_engine_is_freed_without_the_cyclic_collector(tmp_path):
    path = make_model("llama", "tiny", str(tmp_path), seed=0)
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32", device="cpu", max_model_len=64),
                          cache=CacheConfig(num_kv_blocks=64))
    engine = EngineCore(config)
    assert gc.get_freeze_count() > 0  # the start-up heap is frozen
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    engine.add_request(EngineCoreRequest("a", [1, 2, 3, 4, 5], params, [0], 0.0))
    while engine.has_unfinished_requests():  # its blocks went round the pool and the prefix cache
        engine.step()
    alive = [weakref.ref(x) for x in (engine, engine.scheduler, engine.scheduler.kv.pool, engine.runner,
                                      engine.runner.kv_caches[0], engine.runner.model)]
    assert isinstance(alive[2](), BlockPool)
    was_enabled = gc.isenabled()
    gc.disable()  # reference counting only
    try:
        del engine
        assert [ref() is None for ref in alive] == [True] * len(alive)
    finally:
        if was_enabled:
            gc.enable()


def test_blocks_hold_no_links_to_each_other():
    pool = BlockPool(6, enable_caching=True)
    pool.free(pool.allocate(3))  # through the free queue and back
    pool.touch(pool.allocate(2)[:1])
    assert not [r for block in pool.blocks for r in gc.get_referents(block) if isinstance(r, KVBlock)]
