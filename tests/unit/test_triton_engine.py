"""The engine on the Triton attention backend and through the decode-graph and mixed-step-graph buffers: the
same greedy tokens as the torch backend (on CPU the kernel runs under Triton's interpreter, the graph buffers
eagerly; tests/gpu runs both for real)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.testing.maker import make_model  # noqa: E402
from llmserve.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes  # noqa: E402
from llmserve.worker.mixed_graphs import MixedGraphs, max_tiles, mixed_graph_sizes  # noqa: E402

import graph_buffers  # noqa: E402
from spec_cases import repeating_prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=48, device=DEVICE)
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=3)


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(num)]


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(tiny, attention_backend="torch", **ENGINE)
    return {seed: _tokens(llm, _prompts(num, seed)) for seed, num in ((1, 3), (2, 6))}


def test_graph_batch_sizes():
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-2:] == [240, 256]


def test_triton_backend_matches_torch(tiny, reference):
    llm = LLM(tiny, attention_backend="triton", **ENGINE)
    assert llm.engine.runner.attn_backend.name == "triton"
    assert _tokens(llm, _prompts(6, 2)) == reference[2]  # chunked prompts (48-token budget) + decode
    llm.engine.check_integrity()


def test_decode_graph_buffers_match_torch(tiny, reference):
    """Decode steps of 3 rows run padded to 4 through the graph buffers; 6 rows exceed them (eager)."""
    llm = LLM(tiny, attention_backend="triton", enforce_eager=True, **ENGINE)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.attn_backend, runner.kv_caches, max_batch=4, max_blocks=8,
                          device=torch.device(DEVICE), use_graphs=False)
    runs = []
    original_run = graphs.run
    graphs.run = lambda inputs: runs.append(inputs.input_ids.shape[0]) or original_run(inputs)
    runner.graphs = graphs
    assert _tokens(llm, _prompts(3, 1)) == reference[1]
    assert runs and set(runs) <= {1, 2, 3}
    runs.clear()
    assert _tokens(llm, _prompts(6, 2)) == reference[2]
    assert all(n <= 4 for n in runs)  # 6 decode rows ran eagerly; only the tail (<= 4 left) used the buffers
    llm.engine.check_integrity()


def test_mixed_graph_sizes():
    assert mixed_graph_sizes(16) == [16]
    assert mixed_graph_sizes(48) == [32, 48]
    assert mixed_graph_sizes(512)[:3] == [32, 64, 96] and mixed_graph_sizes(512)[-1] == 512
    assert mixed_graph_sizes(100)[-2:] == [96, 100]
    assert mixed_graph_sizes(1024)[15:18] == [512, 576, 640] and len(mixed_graph_sizes(1024)) == 24
    assert mixed_graph_sizes(600)[-2:] == [576, 600]


@pytest.mark.parametrize("seed", range(10))
def test_a_mixed_steps_rows_and_tiles(seed):
    """The rows' metadata of a step of random rows padded to its size: the step's rows, the padding row with the
    rest of the tokens, tiles within the graph's grid and in order, the tiles past them on the empty row."""
    rng = random.Random(seed)
    graphs = MixedGraphs(None, None, [], max_tokens=96, max_rows=8, max_blocks=4, block_size=16,
                         device=torch.device("cpu"), use_graphs=False)
    num_rows = rng.randint(1, 8)
    query_lens = [rng.choice([1, 1, rng.randint(1, 40)]) for _ in range(num_rows)]
    while sum(query_lens) > 96:
        query_lens[rng.randrange(num_rows)] = 1
    seq_lens = [q + rng.randint(0, 30) for q in query_lens]
    size = next(s for s in graphs.sizes if s >= sum(query_lens))
    meta = graphs._row_meta(query_lens, seq_lens, size)
    rows = len(graphs.seq_lens)  # the step's most, the padding row, the empty row
    keys, starts, tiles = meta[:rows], meta[rows:2 * rows + 1], meta[2 * rows + 1:]
    tile_rows, tile_starts = tiles[:len(tiles) // 2], tiles[len(tiles) // 2:]
    num_pad = size - sum(query_lens)
    assert list(keys[:num_rows]) == seq_lens and keys[num_rows] == num_pad and not keys[num_rows + 1:].any()
    assert list(starts[1:num_rows + 1]) == list(np.cumsum(query_lens)) and (starts[num_rows + 1:] == size).all()
    covered = [(r, s) for r, s in zip(tile_rows, tile_starts) if r != graphs.empty_row]
    expected = [(r, s) for r, q in enumerate(query_lens + [num_pad]) for s in range(0, q, 16)]
    assert covered == expected
    assert len(covered) <= graphs.num_tiles[size] == max_tiles(size, 8)
    assert (tile_rows[len(covered):] == graphs.empty_row).all()


def test_mixed_graph_buffers_match_torch(tiny, reference):
    """Every step of up to 48 tokens (prompt chunks beside decode rows, decode steps: no decode graphs here)
    runs padded to 32 or 48 tokens through the mixed-step buffers."""
    llm = LLM(tiny, attention_backend="triton", enforce_eager=True, num_scheduler_steps=1, **ENGINE)
    runner = llm.engine.runner
    runs = graph_buffers.attach(runner, "mixed", max_blocks=8, max_tokens=48, max_rows=6)
    mixes, run = [], runner.mixed_graphs.run
    runner.mixed_graphs.run = lambda inputs: mixes.append(sorted(set(inputs.attn.query_lens_cpu))) or run(inputs)
    assert _tokens(llm, _prompts(6, 2)) == reference[2]
    assert {size for _, size in runs} == {32, 48} and all(tokens <= size for tokens, size in runs)
    assert any(tokens < size for tokens, size in runs)  # padded
    assert any(len(mix) > 1 and mix[0] == 1 for mix in mixes)  # a prompt chunk beside decode rows
    llm.engine.check_integrity()


def test_verification_steps_beside_prompts_through_the_mixed_buffers(tiny):
    """n-gram drafts verified in steps that also carry prompt chunks (no verification graphs here): the mixed-step
    buffers take them, and greedy outputs stay the plain engine's."""
    prompts = repeating_prompts(6, seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = dict(ENGINE, max_num_batched_tokens=32)
    plain = LLM(tiny, attention_backend="torch", **engine)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = LLM(tiny, attention_backend="triton", enforce_eager=True, speculative="ngram", num_speculative_tokens=3,
              speculative_dynamic=False, speculative_max_batch=8, **engine)
    runner = llm.engine.runner
    graph_buffers.attach(runner, "mixed", max_blocks=8, max_tokens=32, max_rows=6)
    steps, run = [], runner.mixed_graphs.run
    runner.mixed_graphs.run = lambda inputs: steps.append(
        (len(inputs.logits_indices) > len(inputs.sample_rows), max(inputs.attn.query_lens_cpu))) or run(inputs)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert any(has_drafts for has_drafts, _ in steps)
    llm.engine.check_integrity()


def test_decode_graph_buffers_split_long_rows_keys(tiny, reference, monkeypatch):
    """Decode steps whose longest row reaches SPLIT_MIN_KEYS (lowered to 8 here) replay their size's graph whose
    attention splits the rows' keys (into 4 parts here): the torch backend's greedy tokens."""
    from llmserve.model import split_keys, triton_kernels

    monkeypatch.setattr(split_keys, "SPLIT_MIN_KEYS", 8)
    monkeypatch.setattr(triton_kernels, "num_splits_for", lambda *args: 4)
    llm = LLM(tiny, attention_backend="triton", enforce_eager=True, num_scheduler_steps=1, **ENGINE)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.attn_backend, runner.kv_caches, max_batch=4, max_blocks=8,
                          device=torch.device(DEVICE), use_graphs=False)
    assert graphs.split_sizes == [1, 2, 4] and (4, True) in graphs.keys  # a 2-kv-head model: few programs
    keys, replay = [], graphs._replay
    graphs._replay = lambda key, num_tokens: keys.append(key) or replay(key, num_tokens)
    runner.graphs = graphs
    assert _tokens(llm, _prompts(3, 1)) == reference[1]
    assert any(is_split for _, is_split in keys)
    llm.engine.check_integrity()


def test_mixed_graph_buffers_through_prefix_hits_and_preemption(tiny):
    """Prompts sharing a cached prefix, in a KV cache small enough to preempt, every step through the mixed-step
    buffers: transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    import hf_parity

    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(16)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(n)] for n in (5, 9, 3, 7)]
    llm = LLM(tiny, attention_backend="triton", enforce_eager=True, num_scheduler_steps=1, dtype="float32",
              max_model_len=48, block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, device=DEVICE)
    runs = graph_buffers.attach(llm.engine.runner, "mixed", max_blocks=16, max_tokens=32, max_rows=4)
    outs = llm.generate(prompts[:1], PARAMS) + llm.generate(prompts[1:], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.num_preemptions > 0, "the small cache was meant to preempt"
    assert all(o.num_cached_tokens >= 16 for o in outs[1:])  # the first prompt's prefix, cached
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    want = [hf_parity.hf_greedy(hf, p, n) for p, n in zip(prompts, (5, 12, 12, 12))]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert any(tokens < size for tokens, size in runs)
    llm.engine.check_integrity()
