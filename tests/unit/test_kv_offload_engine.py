"""KV tiers in the engine (float32 tiny model): a prefix evicted from the device and hit in host memory or on
disk gives the same greedy tokens as without tiers and computes only the rest of the prompt; a corrupt disk
block is recomputed; a load runs while other requests step, and an abort during it frees everything; saves
run off the step loop, their blocks held until copied; the bookkeeping holds after churn; the flags are
validated; disaggregation of a sliding-window model gives a colocated engine's tokens."""

import json
import os
import random
import threading

import pytest

from llmserve import LLM, SamplingParams
from llmserve.core.request import Request
from llmserve.sampling_params import KVTransferParams
from llmserve.testing.maker import make_model

NUM_PROMPT = 200  # 12 full blocks of 16 and 8 tokens; the 40-block cache holds two such requests
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny qwen3: layers x (k, v) x block x kv heads x head dim x float32


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("offload")), seed=7)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(NUM_PROMPT)] for _ in range(4)]


def _llm(path, **kwargs) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256, num_kv_blocks=40, max_num_batched_tokens=256, **kwargs)


def _turns(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt in turn (the later ones evict the earlier ones' blocks from the device), then the first
    again: (greedy tokens, prompt tokens not computed) each."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [llm.generate([p], params)[0] for p in prompts + prompts[:1]]
    llm.engine.check_integrity()
    return [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs]


@pytest.fixture(scope="module")
def plain(path, prompts):
    return _turns(_llm(path), prompts)


def test_a_prefix_evicted_from_the_device_comes_back_from_host_memory(path, prompts, plain):
    llm = _llm(path, kv_offload_memory="64MiB")
    outs = _turns(llm, prompts)
    assert [t for t, _ in outs] == [t for t, _ in plain]
    assert plain[-1][1] == 0  # without tiers: evicted, recomputed
    assert outs[-1][1] == 192  # with: every full block of the prompt loaded
    assert llm.kv_tier_stats.num_host_hit_tokens == 192 and llm.kv_tier_stats.num_disk_hit_tokens == 0
    assert llm.num_prompt_tokens_computed == 5 * NUM_PROMPT - 192


def test_host_evictions_go_to_disk_and_come_back_from_it(path, prompts, plain, tmp_path):
    llm = _llm(path, kv_offload_memory=str(8 * BLOCK_BYTES), kv_offload_disk=str(tmp_path))
    outs = _turns(llm, prompts)
    assert [t for t, _ in outs] == [t for t, _ in plain]
    assert outs[-1][1] == 192
    stats = llm.kv_tier_stats
    assert stats.num_disk_hit_tokens > 0 and stats.num_host_hit_tokens + stats.num_disk_hit_tokens == 192
    llm.engine.shutdown()
    assert not os.listdir(tmp_path)  # the tier's directory goes with it


def test_a_corrupt_disk_block_is_recomputed_never_used(path, prompts, plain, tmp_path):
    llm = _llm(path, kv_offload_disk=str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt in prompts:
        llm.generate([prompt], params)
    disk = llm.engine.kv_connector.disk
    # the first prompt's 5th block: its blocks 1-4 still load, the rest are recomputed
    fifth = Request("probe", prompts[0], params, [], 0.0, 8).update_block_hashes(16)[4]
    with open(disk.path(fifth.value), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    out = llm.generate([prompts[0]], params)[0]
    assert out.outputs[0].token_ids == plain[-1][0]
    assert out.num_cached_tokens == 4 * 16
    assert llm.kv_tier_stats.num_corrupt_blocks == 1
    llm.engine.check_integrity()
    llm.engine.shutdown()


def _hold_loads(llm: LLM, monkeypatch) -> threading.Event:
    """The connector's loads wait, on its loader thread, until the returned event is set."""
    connector = llm.engine.kv_connector
    gate, read = threading.Event(), connector._read

    def held(loads, blocks):
        assert gate.wait(timeout=120), "the test never let the load go"
        return read(loads, blocks)

    monkeypatch.setattr(connector, "_read", held)
    return gate


def _add(llm: LLM, request_id: str, prompt: list[int], max_tokens: int = 8) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for request in llm.processor.process(request_id, prompt, params):
        llm.engine.add_request(request)


def _evict_first(llm: LLM, prompts: list[list[int]]) -> None:
    for prompt in prompts:  # the later prompts evict the first one's blocks into the host tier
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))


def test_other_requests_step_while_a_prefix_loads(path, prompts, plain, monkeypatch):
    llm = _llm(path, kv_offload_memory="64MiB")
    _evict_first(llm, prompts)
    gate, engine = _hold_loads(llm, monkeypatch), llm.engine
    _add(llm, "again", prompts[0])
    _add(llm, "other", [7, 8, 9], max_tokens=20)
    tokens: dict[str, list[int]] = {"again": [], "other": []}
    for _ in range(5):
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
        assert engine.scheduler.requests["again"].status.name == "WAITING_FOR_KV"
        engine.check_integrity()
    assert tokens["again"] == [] and len(tokens["other"]) == 5  # the other stream went on meanwhile
    gate.set()
    num_cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            num_cached[out.request_id] = out.num_cached_tokens
    assert tokens["again"] == plain[-1][0] and num_cached["again"] == 192  # loaded, not computed
    engine.check_integrity()


def test_an_abort_during_a_load_leaves_nothing_held(path, prompts, monkeypatch, tmp_path):
    llm = _llm(path, kv_offload_memory=str(4 * BLOCK_BYTES), kv_offload_disk=str(tmp_path))
    _evict_first(llm, prompts)
    gate, engine = _hold_loads(llm, monkeypatch), llm.engine
    _add(llm, "again", prompts[0])
    engine.step()
    engine.abort_requests(["again"])
    assert [out.request_id for out in engine.step().outputs] == ["again"]
    engine.check_integrity()
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.num_free_blocks() == engine.scheduler.kv.pool.num_usable_blocks
    engine.shutdown()


def _hold_saves(llm: LLM, monkeypatch) -> threading.Event:
    """The connector's saves wait, on its save thread, before reading the device, until the event is set."""
    connector = llm.engine.kv_connector
    gate, read = threading.Event(), connector._read_device

    def held(saves, written):
        assert gate.wait(timeout=120), "the test never let the save go"
        return read(saves, written)

    monkeypatch.setattr(connector, "_read_device", held)
    return gate


def test_saves_run_off_the_step_loop_and_hold_their_blocks_until_copied(path, prompts, monkeypatch):
    llm = _llm(path, kv_offload_memory="64MiB")
    gate, engine = _hold_saves(llm, monkeypatch), llm.engine
    _add(llm, "first", prompts[0], max_tokens=1)
    _add(llm, "other", [7, 8, 9], max_tokens=12)  # never fills a block: nothing of it is saved
    while "first" in engine.scheduler.requests:
        engine.step()
    saves, pool = engine.scheduler.kv.saves, engine.scheduler.kv.pool
    held = {block.block_id for block in saves.held_blocks()}
    assert len(held) == 12  # the first prompt's full blocks, their copy not started
    num_tokens = 0
    for _ in range(4):  # the other stream steps on; no block a save holds is handed out meanwhile
        num_tokens += sum(len(out.new_token_ids) for out in engine.step().outputs)
        assert {block.block_id for block in saves.held_blocks()} == held
        assert not held & set(pool.free_queue.block_ids())
        engine.check_integrity()
    assert num_tokens == 4 and len(engine.kv_connector.host) == 0
    gate.set()
    while engine.has_unfinished_requests():  # until the saves are in the tiers
        engine.step()
    assert len(engine.kv_connector.host) == 12 and engine.num_free_blocks() == pool.num_usable_blocks
    engine.check_integrity()
    engine.shutdown()


def test_churn_keeps_every_count_in_step(path):
    llm = _llm(path, kv_offload_memory=str(60 * BLOCK_BYTES), max_num_seqs=4)  # a copy of the 40-block cache, and more
    rng = random.Random(1)
    shared = [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 120))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for _ in range(4):
        batch = [rng.choice(shared) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
        llm.generate(batch, params)
        llm.engine.check_integrity()
    assert llm.kv_tier_stats.num_offloaded_blocks > 0 and llm.kv_tier_stats.num_host_hit_tokens > 0
    assert llm.engine.reset_prefix_cache()
    assert len(llm.engine.kv_connector.host) == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_offload_memory": "lots"}, "--kv-offload-memory"),
    ({"kv_offload_memory": "0"}, "--kv-offload-memory: must be positive"),
    ({"kv_offload_disk_bytes": "1GiB"}, "--kv-offload-disk-bytes: only with --kv-offload-disk"),
    ({"kv_offload_memory": "1GiB", "enable_prefix_caching": False}, "needs prefix caching"),
    ({"disaggregation_mode": "both"}, "--disaggregation-mode: must be one of"),
    ({"disaggregation_mode": "prefill", "tensor_parallel_size": 2}, "tensor parallelism"),
    ({"disaggregation_mode": "decode", "disaggregation_kv_port": 70000}, "--disaggregation-kv-port: must be a TCP port"),
    ({"disaggregation_kv_port": 9000}, "--disaggregation-kv-port: only with --disaggregation-mode decode"),
])
def test_flags_are_validated_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("/nonexistent", **kwargs)


def test_disaggregation_of_a_sliding_window_model_gives_a_colocated_engines_tokens(tmp_path, prompts):
    """Gemma 3's layout (six KV cache groups, five sliding of window 8): the prefill engine sends every
    group's blocks of the prompt (the sliding groups' early ones too, still cached) and the decode engine
    loads them all; its greedy tokens are those of an engine that computes the prompt itself."""
    path = make_model("gemma3", "tiny-gemma3", str(tmp_path), seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def llm(**kwargs) -> LLM:
        return LLM(path, dtype="float32", max_model_len=256, num_kv_blocks=200, max_num_batched_tokens=64, **kwargs)

    colocated = llm()
    plain = [colocated.generate([p], params)[0].outputs[0].token_ids for p in prompts[:2]]
    decode = llm(disaggregation_mode="decode", disaggregation_kv_port=0)
    prefill = llm(disaggregation_mode="prefill")
    address = KVTransferParams(decode_kv_address=f"tcp://127.0.0.1:{decode.engine.kv_receiver.port}")
    try:
        for prompt, expected in zip(prompts[:2], plain):
            prefill.generate([prompt], SamplingParams(temperature=0, max_tokens=1, kv_transfer_params=address))
            out = decode.generate([prompt], params)[0]
            assert out.outputs[0].token_ids == expected and out.num_cached_tokens == 192
        assert decode.kv_tier_stats.num_received_blocks == 2 * 12 * 6  # every group's 12 full blocks
        for engine in (prefill, decode):
            engine.engine.check_integrity()
    finally:
        for engine in (prefill, decode):
            engine.engine.shutdown()


def test_a_sliding_window_models_groups_come_back_from_the_tiers(tmp_path, prompts):
    """Gemma 3's layout (five sliding layers to one full: six KV cache groups): each group's blocks are kept
    apart in the tiers and loaded back together; the tokens are those computed without tiers."""
    path = make_model("gemma3", "tiny-gemma3", str(tmp_path), seed=6)

    def run(**kwargs):
        llm = LLM(path, dtype="float32", max_model_len=256, num_kv_blocks=100, max_num_batched_tokens=256, **kwargs)
        assert llm.engine.scheduler.kv.num_groups == 6
        return llm, _turns(llm, prompts)

    _, plain = run()
    llm, tiered = run(kv_offload_memory="64MiB", kv_offload_disk=str(tmp_path / "disk"))
    assert [t for t, _ in tiered] == [t for t, _ in plain]
    assert plain[-1][1] == 0 and tiered[-1][1] == 192  # evicted from the device, loaded from the tiers
    stats = llm.kv_tier_stats
    assert stats.num_host_hit_tokens + stats.num_disk_hit_tokens == 192
    llm.engine.shutdown()
