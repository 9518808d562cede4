"""KV cache groups for models that mix full and sliding-window layers: how layers are grouped, each group's
blocks (exact ids, groups interleaved), prefix hits every group serves, and the capacity a 5:1 model gains
at a long context."""

from __future__ import annotations

import pytest

from llmserve.core.kv_cache_groups import kv_cache_layout
from llmserve.core.kv_cache_manager import KVCacheManager, cdiv

from core_helpers import advance, ids, make_request, make_scheduler, run_with_an_abort, step

W = 6  # the sliding groups' window in the manager tests; blocks of 4 tokens


def test_gemma3_layers_form_six_groups_of_two():
    """5:1 over 12 layers: the two full layers form one group, the ten sliding ones five; tensor j holds the
    j-th layer of every group."""
    windows = ([W] * 5 + [0]) * 2
    layout = kv_cache_layout(windows)
    assert layout.group_windows == (0, W, W, W, W, W) and layout.num_slots == 2
    assert layout.layer_groups == (1, 1, 2, 2, 3, 0, 3, 4, 4, 5, 5, 0)
    assert layout.layer_slots == (0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1)


def test_alternating_layers_form_two_groups_and_close_counts_pad():
    assert kv_cache_layout([W, 0] * 3).group_windows == (0, W)
    padded = kv_cache_layout([0] * 6 + [W] * 5)  # 6 and 5 (< 1.25 x): one group each, the sliding one padded
    assert padded.group_windows == (0, W) and padded.num_slots == 6
    assert padded.layer_slots == (0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4)
    split = kv_cache_layout([0] * 5 + [W] * 4)  # 5 and 4: the full layers split in groups of 4 (one of 1)
    assert split.group_windows == (0, 0, W) and split.num_slots == 4


def test_one_kind_or_disabled_is_one_group():
    assert kv_cache_layout([W, W]).group_windows == (W,)
    assert kv_cache_layout([0, 0, 0]).group_windows == (0,)
    disabled = kv_cache_layout([W, 0, W], is_hybrid_enabled=False)
    assert disabled.group_windows == (0,) and disabled.num_slots == 3 and disabled.layer_slots == (0, 1, 2)


def test_the_sliding_group_gives_back_what_the_full_group_keeps():
    """Groups (full, sliding W=6), interleaved: entry 2i is the full group's block i, 2i + 1 the sliding one's."""
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_caching=False, group_windows=(0, W))
    request = make_request("a", list(range(1, 9)), max_tokens=20)
    advance(kv, request, 8)
    assert ids(kv, request) == [1, 2, 3, 4]
    advance(kv, request, 1)  # token 8 reads 3..8: the sliding group still reads its block 0
    assert ids(kv, request) == [1, 2, 3, 4, 5, 6]
    advance(kv, request, 1)  # token 9 reads 4..9: the sliding group's block 0 goes back, the full one's stays
    assert ids(kv, request) == [1, 0, 3, 4, 5, 6]
    assert kv.pool.free_queue.block_ids()[-1] == 2
    for _ in range(4):
        advance(kv, request, 1)
    assert ids(kv, request) == [1, 0, 3, 0, 5, 6, 7, 8]  # token 13 reads 8..13
    assert kv.num_held_blocks("a", group=0) == 4 and kv.num_held_blocks("a", group=1) == 2
    kv.check_integrity()
    kv.check_request(request)
    kv.free(request)
    assert kv.pool.get_num_free_blocks() == 19
    kv.check_integrity()


def test_admission_counts_every_group():
    """A prompt of 3 blocks needs 3 a group: 6 free blocks, not 3."""
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, group_windows=(0, W))
    assert kv.allocate_slots(make_request("a", list(range(1, 13))), 12) is None
    assert not kv.req_to_blocks
    kv = KVCacheManager(num_blocks=7, block_size=4, enable_caching=False, group_windows=(0, W))
    assert len(kv.allocate_slots(make_request("a", list(range(1, 13))), 12)) == 6


def _cached_request(kv: KVCacheManager, tokens: list[int]):
    request = make_request("a", tokens, max_tokens=4)
    for _ in range(len(tokens) // 4):
        advance(kv, request, 4)
    return request


def test_a_hit_needs_the_full_group_s_prefix_and_the_sliding_group_s_window():
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, group_windows=(0, W))
    first = _cached_request(kv, list(range(1, 17)))  # 4 blocks a group; the sliding group gave back block 0
    assert ids(kv, first) == [1, 0, 3, 4, 5, 6, 7, 8]
    kv.free(first)
    again = make_request("b", list(range(1, 17)) + [50, 51])
    hits, num_hit = kv.get_computed_blocks(again)
    # the full group's four blocks; the sliding group's last two (a query at 16 reads 11..16) after nulls
    assert [b.block_id for b in hits] == [1, 0, 3, 0, 5, 6, 7, 8] and num_hit == 16
    assert kv.allocate_slots(again, 2, hits) is not None
    kv.check_integrity()
    kv.check_request(again)


def test_the_full_group_s_hit_is_cut_where_the_sliding_group_misses():
    """The sliding group's blocks that left the window go back (still cached) before the full group's: once they
    are evicted, the sliding group serves no hit and the full group's three cached blocks are not used."""
    kv = KVCacheManager(num_blocks=15, block_size=4, enable_caching=True, group_windows=(0, W))
    first = make_request("a", list(range(1, 25)), max_tokens=4)
    for _ in range(6):
        advance(kv, first, 4)
    advance(kv, first, 1)
    assert ids(kv, first) == [1, 0, 3, 0, 5, 0, 7, 0, 9, 10, 11, 12, 13, 14]
    assert kv.pool.free_queue.block_ids() == [2, 4, 6, 8]  # given back, cached
    shared = list(range(1, 13)) + [60, 61]  # its first three blocks are the first request's
    hits, num_hit = kv.get_computed_blocks(make_request("b", shared))
    assert [b.block_id for b in hits] == [1, 0, 3, 4, 5, 6] and num_hit == 12  # a query at 12 reads 7..12
    advance(kv, make_request("o", [99] * 4), 4)  # evicts the sliding group's blocks 0 and 1 (ids 2 and 4)
    hits, num_hit = kv.get_computed_blocks(make_request("c", shared))
    assert hits == [] and num_hit == 0
    kv.check_integrity()


@pytest.mark.parametrize("caching", [False, True])
def test_nothing_leaks_through_preemption_and_aborts(caching):
    """49 blocks: one sequence of max_model_len in each of the three groups; six requests need more at once."""
    sched = make_scheduler(num_blocks=49, block_size=4, budget=16, max_num_seqs=6, caching=caching,
                           max_model_len=64, group_windows=(0, W, W))
    requests = [make_request(f"r{i}", [1 + (i * 3 + j) % 7 for j in range(20 + 5 * i)], max_tokens=12,
                             ignore_eos=True) for i in range(6)]
    run_with_an_abort(sched, requests, abort_at=7, abort_id="r4")


NUM_OUT = 256  # decode steps enough for every admitted request to reach its decode at once


def peak_long_sequences(num_blocks: int, group_windows: tuple[int, ...], context: int, budget: int,
                        block_size: int = 16) -> int:
    """The most requests that decode at once past a `context`-token prompt, from one pool of num_blocks."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=budget, max_num_seqs=256,
                           caching=False, max_model_len=context + NUM_OUT, group_windows=group_windows)
    for i in range(40):
        sched.add_request(make_request(f"r{i}", [1 + i % 50] * context, max_tokens=NUM_OUT, ignore_eos=True))
    peak = 0
    while sched.has_unfinished_requests():
        step(sched)
        peak = max(peak, sum(r.num_computed_tokens >= context for r in sched.running))
    sched.check_integrity()
    return peak


def predicted_long_sequences(num_usable: int, group_windows: tuple[int, ...], context: int, budget: int,
                             block_size: int = 16) -> int:
    """How many such requests hold blocks at once: one computing its prompt's last chunk (each sliding group
    holds the window before the chunk and the chunk), the others decoding (the full groups every block, each
    sliding group its window's and the one being filled)."""
    num_full_blocks = cdiv(context + NUM_OUT, block_size)

    def need(num_tokens: int) -> int:
        return sum(min(num_full_blocks, cdiv(window - 1 + num_tokens, block_size) + 1) if window else num_full_blocks
                   for window in group_windows)

    return 1 + (num_usable - need(budget)) // need(1)


@pytest.mark.parametrize("name,layer_kinds,window", [("gemma-3", 6, 1024), ("gpt-oss", 2, 128)])
def test_a_mixed_model_admits_the_predicted_factor_more_long_sequences(name, layer_kinds, window):
    """16k-token prompts, one pool's bytes. Gemma 3 (5 sliding layers to 1 full, window 1,024): in one group a
    block holds six layers' KV and a request keeps every block; in six groups a block holds one layer's, and
    a request keeps the full group's blocks and each sliding group's window. gpt-oss: alternating, window 128."""
    context, block_size, budget, num_full_seqs = 16384, 16, 4096, 4
    num_usable = num_full_seqs * cdiv(context + NUM_OUT, block_size)  # four sequences in one group of all layers
    full = peak_long_sequences(num_usable + 1, (0,), context, budget)
    group_windows = (0,) + (window,) * (layer_kinds - 1)
    hybrid = peak_long_sequences(layer_kinds * num_usable + 1, group_windows, context, budget)
    predicted = predicted_long_sequences(layer_kinds * num_usable, group_windows, context, budget)
    print(f"{name} (window {window}) at {context} tokens: {full} sequences at once in one group, {hybrid} in "
          f"{layer_kinds} groups (predicted {predicted}: x{predicted / full:.2f}; measured x{hybrid / full:.2f})")
    assert full == num_full_seqs
    assert hybrid == predicted


# ---- engines: random-weight Gemma 3 and gpt-oss, windows shorter than prompt + output --------------------

def _watch_held_blocks(llm) -> list[tuple[int, int]]:
    """After every engine step, per request: (its full group's blocks, the most any sliding group holds)."""
    kv, held, original = llm.engine.scheduler.kv, [], llm.engine.step
    full = [g for g, w in enumerate(kv.group_windows) if not w]
    sliding = [g for g, w in enumerate(kv.group_windows) if w]

    def step():
        outputs = original()
        held.extend((max(kv.num_held_blocks(r, g) for g in full), max(kv.num_held_blocks(r, g) for g in sliding))
                    for r in kv.req_to_blocks)
        llm.engine.check_integrity()
        return outputs

    llm.engine.step = step
    return held


def _greedy_through_chunks_hits_and_preemption(path: str, hf, group_windows: tuple[int, ...], window: int,
                                               vocab: int) -> None:
    """Chunks of 8 tokens, a pool that holds one sequence of max_model_len (five long prompts need more at once:
    they are preempted), then a prompt that shares the first 24 tokens of one that ran last (a prefix hit: the
    full group's six blocks and the sliding groups' last two)."""
    from functools import partial

    import hf_parity
    from llmserve import LLM

    prompt = partial(hf_parity.random_prompt, vocab_size=vocab)
    num_blocks = kv_cache_layout(group_windows).blocks_per_sequence(64, 4, 8) + 1  # the fewest the engine takes
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=num_blocks,
              max_num_batched_tokens=8, enable_prefix_caching=True)
    assert llm.engine.scheduler.kv.group_windows == group_windows
    held = _watch_held_blocks(llm)
    prompts = [prompt(40, 11), prompt(27, 13), prompt(33, 12), prompt(45, 14), prompt(38, 15), prompt(5, 20)]
    outs = hf_parity.engine_greedy(llm, prompts, num_out=8)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 8) for p in prompts]
    assert llm.num_preemptions > 0
    hf_parity.engine_greedy(llm, [prompts[1]], num_out=8)  # alone: nothing evicts the blocks it gives back
    longer = prompts[1][:24] + prompt(6, 30)
    (out,) = hf_parity.engine_greedy(llm, [longer], num_out=8)
    assert out.num_cached_tokens >= 20 and list(out.outputs[0].token_ids) == hf_parity.hf_greedy(hf, longer, 8)
    # a sliding group holds its window (and one prompt chunk) whatever the length; the full group everything
    assert max(s for _, s in held) <= cdiv(window - 1 + 8, 4) + 1 < max(f for f, _ in held)
    pool = llm.engine.scheduler.kv.pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_gemma3_five_to_one_greedy_equals_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    import test_gemma3_model as gemma3

    path = gemma3.write_checkpoint(str(tmp_path / "gemma3"), seed=3, num_hidden_layers=6,
                                   layer_types=["sliding_attention"] * 5 + ["full_attention"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _greedy_through_chunks_hits_and_preemption(path, hf, (0,) + (gemma3.WINDOW,) * 5, gemma3.WINDOW, gemma3.VOCAB)


def test_gpt_oss_alternating_greedy_equals_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    import test_gpt_oss_model as gpt_oss

    path = gpt_oss.write_checkpoint(str(tmp_path / "gpt_oss"), seed=2, num_hidden_layers=4,
                                    layer_types=["sliding_attention", "full_attention"] * 2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _greedy_through_chunks_hits_and_preemption(path, hf, (0, gpt_oss.WINDOW), gpt_oss.WINDOW, gpt_oss.VOCAB)


def test_a_draft_model_keeps_its_cache_in_the_full_group(tmp_path):
    """gpt-oss alternating sliding and full layers as its own draft: greedy tokens as without speculation through
    prompts several windows long, chunked, and every draft accepted (the draft read back its own KV from the full
    group's blocks while the sliding group gave its blocks back)."""
    import torch

    from llmserve import LLM, SamplingParams
    from llmserve.bench.spec import SpecCounter

    import test_gpt_oss_model as gpt_oss

    path = gpt_oss.write_checkpoint(str(tmp_path / "gpt_oss"), seed=3, num_hidden_layers=4,
                                    layer_types=["sliding_attention", "full_attention"] * 2)
    engine = dict(dtype="float32", max_model_len=96, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(n)] for i, n in enumerate((5, 30, 41))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, **engine).generate(prompts, params)]
    llm = LLM(path, speculative="draft", draft_model=path, num_speculative_tokens=3, speculative_max_batch=8, **engine)
    assert llm.engine.runner.kv_layout.num_groups == 2
    counts = SpecCounter(llm)
    proposer, seen = llm.engine.runner.speculator.proposer, {}
    original_propose = proposer.propose
    proposer.propose = lambda rows: seen.update({r.req_id: (list(r.block_ids), len(r.token_ids)) for r in rows}) \
        or original_propose(rows)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert counts.num_draft_tokens > 0 and counts.num_accepted == counts.num_draft_tokens
    llm.engine.check_integrity()
    target_cache, draft_cache = llm.engine.runner.kv_caches[1], proposer.kv_caches[1]  # layer 1: full attention
    for block_ids, num_tokens in seen.values():  # the draft's KV of its full layer is the target's, block by block
        full_blocks = torch.tensor(block_ids[0::2][:(num_tokens - 1) // 4])  # group 0's complete blocks
        torch.testing.assert_close(draft_cache[:, full_blocks], target_cache[:, full_blocks], atol=1e-4, rtol=1e-4)


def test_a_draft_model_is_refused_without_a_full_group():
    from llmserve.config import EngineConfig, SpeculativeConfig
    from llmserve.engine.engine_core import checked_kv_cache_layout

    config = EngineConfig(speculative=SpeculativeConfig(speculative="draft", draft_model="d"))
    assert checked_kv_cache_layout(config, (0, W)).num_groups == 2
    with pytest.raises(ValueError, match="add --disable-hybrid-kv-cache-manager"):
        checked_kv_cache_layout(config, (4, W))  # two windows, no full layer


def test_graph_buffers_hold_a_table_per_group(tmp_path):
    """Steps through the CUDA-graph buffers (run eagerly off CUDA) of the Triton kernel (its interpreter): one
    block table and slot buffer a group, each layer given its group's. Decode steps: three rows padded to four;
    prompt chunks beside decode rows: the mixed-step buffers, 16 tokens (the padding row: null block)."""
    pytest.importorskip("triton")
    import torch
    from transformers import AutoModelForCausalLM

    import graph_buffers
    import hf_parity
    import test_gemma3_model as gemma3
    from llmserve import LLM

    path = gemma3.write_checkpoint(str(tmp_path / "gemma3"), seed=1)  # sliding, sliding, full, sliding
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
              attention_backend="triton", device=device, enforce_eager=True, num_scheduler_steps=1)
    runner = llm.engine.runner
    assert runner.kv_layout.group_windows == (0, gemma3.WINDOW, gemma3.WINDOW, gemma3.WINDOW)
    decode_runs = graph_buffers.attach(runner, "decode", max_blocks=16, layer_groups=runner.kv_layout.layer_groups)
    mixed_runs = graph_buffers.attach(runner, "mixed", max_blocks=16, max_tokens=16, max_rows=3,
                                      layer_groups=runner.kv_layout.layer_groups)
    prompts = [hf_parity.random_prompt(n, seed, gemma3.VOCAB) for n, seed in ((21, 5), (13, 6), (17, 7))]
    outs = hf_parity.engine_greedy(llm, prompts, num_out=8)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 8) for p in prompts]
    assert (3, 4) in decode_runs and (16, 16) in mixed_runs
    llm.engine.check_integrity()


def test_ngram_drafts_and_async_scheduling_with_groups(tmp_path):
    """Verification steps (a row's token and its drafts) and overlapped steps read each group's table: greedy
    tokens still equal transformers'."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_parity
    import test_gemma3_model as gemma3
    from llmserve import LLM

    path = gemma3.write_checkpoint(str(tmp_path / "gemma3"), seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
              speculative="ngram", num_speculative_tokens=3, async_scheduling=True)
    verified = []
    observe = llm.engine.scheduler.spec_counter.observe
    llm.engine.scheduler.spec_counter.observe = lambda *args: verified.append(args) or observe(*args)
    prompts = [[5, 6, 7, 8] * 5 + [5, 6], hf_parity.random_prompt(19, 3, gemma3.VOCAB)]
    outs = hf_parity.engine_greedy(llm, prompts, num_out=12)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 12) for p in prompts]
    assert verified
    llm.engine.check_integrity()
