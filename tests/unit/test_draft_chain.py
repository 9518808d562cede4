"""The draft model's later forwards on the device (spec.draft_chain): the drafts it proposes are the
host path's (same rows, same draft KV), and greedy speculation through it still equals plain decoding.
On CPU the decode-graph buffers run eagerly and the Triton attention under its interpreter (tests/gpu
runs the captured graphs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.spec.draft_chain import DraftChain  # noqa: E402
from llmserve.worker.cuda_graphs import DecodeGraphs  # noqa: E402

from spec_cases import draft, repeating_prompts, target  # noqa: E402, F401 (fixtures)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=96, attention_backend="triton", device=DEVICE)
PLAIN = {**ENGINE, "attention_backend": "auto"}  # the references: the device's default backend (CPU: no interpreter)
K = 3


def _chained_llm(target: str, draft: str, after_verify: bool = False, draft_vocab_size: int | None = None) -> LLM:
    """after_verify: with the catch-up buffers too, so proposals can be queued behind their verification."""
    llm = LLM(target, speculative="draft", draft_model=draft, num_speculative_tokens=K, speculative_dynamic=False,
              speculative_max_batch=8, enforce_eager=True, draft_vocab_size=draft_vocab_size, **ENGINE)
    proposer = llm.engine.runner.speculator.proposer
    buffers = dict(max_batch=8, max_blocks=8, device=torch.device(DEVICE), use_graphs=False)
    graphs = DecodeGraphs(proposer.model, proposer.attn_backend, proposer.kv_caches, **buffers)
    catch_up = DecodeGraphs(proposer.model, proposer.attn_backend, proposer.kv_caches, queries_per_row=K + 2,
                            **buffers) if after_verify else None
    proposer.chain = DraftChain(proposer.head, graphs, proposer.block_size, torch.device(DEVICE), catch_up)
    return llm


def _record_both_paths(proposer) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Each proposal computed twice from the same state: through the host path, then the chain."""
    calls = []
    original = proposer.propose

    def propose(rows):
        if not proposer._can_chain(rows):
            return original(rows)
        computed = [row.num_draft_computed for row in rows]
        chain, proposer.chain = proposer.chain, None
        host, _ = original(rows)
        proposer.chain = chain
        for row, num in zip(rows, computed):
            row.num_draft_computed = num
        chained, probs = original(rows)
        calls.append((host, chained))
        return chained, probs

    proposer.propose = propose
    return calls


def test_chained_drafts_are_the_host_paths(target, draft):
    llm = _chained_llm(target, draft)
    calls = _record_both_paths(llm.engine.runner.speculator.proposer)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(repeating_prompts(3, seed=5), params)
    assert calls and llm.engine.runner.speculator.proposer.num_chained >= len(calls)
    assert {len(row) for host, _ in calls for row in host} == {K}
    pairs = [(h, c) for host, chained in calls for hr, cr in zip(host, chained) for h, c in zip(hr, cr)]
    assert sum(h == c for h, c in pairs) >= 0.95 * len(pairs), pairs  # float sums of a padded batch: near-ties
    llm.engine.check_integrity()


def test_a_reduced_draft_head_chains_as_the_host_path_drafts(target, draft):
    """The draft's head cut to the first 200 of 512 ids: both paths draft among those only, alike."""
    llm = _chained_llm(target, draft, draft_vocab_size=200)
    calls = _record_both_paths(llm.engine.runner.speculator.proposer)
    llm.generate(repeating_prompts(2, seed=5), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    pairs = [(h, c) for host, chained in calls for hr, cr in zip(host, chained) for h, c in zip(hr, cr)]
    assert pairs and sum(h == c for h, c in pairs) >= 0.95 * len(pairs), pairs
    assert max(max(h, c) for h, c in pairs) < 200
    llm.engine.check_integrity()


def test_greedy_speculation_through_the_chain_equals_plain(target, draft):
    prompts = repeating_prompts(3, seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(target, enforce_eager=True, **PLAIN)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = _chained_llm(target, draft)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.speculator.proposer.num_chained > 0
    assert sum(a == b for a, b in zip(got, want)) >= len(want) - 1, (got, want)  # one near-tie allowed
    llm.engine.check_integrity()


def test_sampled_rows_take_the_host_path(target, draft):
    llm = _chained_llm(target, draft)
    llm.generate(repeating_prompts(2, seed=9), SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True))
    assert llm.engine.runner.speculator.proposer.num_chained == 0


def test_verification_steps_through_graph_buffers_equal_plain(target, draft):
    """Rows of 1 + K queries (token and drafts) run padded through the verification buffers; mixed steps eagerly."""
    prompts = repeating_prompts(3, seed=11)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target, enforce_eager=True, **PLAIN).generate(prompts, params)]
    llm = _chained_llm(target, draft)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.attn_backend, runner.kv_caches, max_batch=4, max_blocks=8,
                          device=torch.device(DEVICE), use_graphs=False, queries_per_row=K + 1)
    runs = []
    original_run = graphs.run
    graphs.run = lambda inputs: runs.append(inputs.input_ids.shape[0]) or original_run(inputs)
    runner.verify_graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs and all(n % (K + 1) == 0 for n in runs)
    assert sum(a == b for a, b in zip(got, want)) >= len(want) - 1, (got, want)  # one near-tie allowed
    llm.engine.check_integrity()


def _record_early_and_chained(proposer) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Each proposal queued behind its verification, and the chain's from the same state (its catch-up
    rewrites the real tokens' draft KV with the same values); the engine goes on with the queued one."""
    calls = []
    original = proposer.propose

    def propose(rows):
        if proposer.early is None:
            return original(rows)
        computed = [row.num_draft_computed for row in rows]
        early, probs = original(rows)
        assert proposer.early is None
        lengths = [row.num_draft_computed for row in rows]
        for row, num in zip(rows, computed):
            row.num_draft_computed = num
        chained, _ = original(rows)
        assert [row.num_draft_computed for row in rows] == lengths
        calls.append((early, chained))
        return early, probs

    proposer.propose = propose
    return calls


def test_queued_drafts_are_the_chains_and_greedy_speculation_equals_plain(target, draft):
    prompts = repeating_prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target, enforce_eager=True, **PLAIN).generate(prompts, params)]
    llm = _chained_llm(target, draft, after_verify=True)
    proposer = llm.engine.runner.speculator.proposer
    calls = _record_early_and_chained(proposer)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls and proposer.num_early == len(calls) and proposer.early is None
    pairs = [(e, c) for early, chained in calls for er, cr in zip(early, chained) for e, c in zip(er, cr)]
    assert {len(row) for early, _ in calls for row in early} == {K}
    assert sum(e == c for e, c in pairs) >= 0.95 * len(pairs), pairs  # float sums of other shapes: near-ties
    assert sum(a == b for a, b in zip(got, want)) >= len(want) - 1, (got, want)  # one near-tie allowed
    llm.engine.check_integrity()


def test_stops_inside_accepted_drafts_equal_plain_with_queued_proposals(target, draft):
    """Rows that stop partway through a step's accepted drafts end where plain decoding ends them."""
    prompts = repeating_prompts(2, seed=13)
    plain = LLM(target, enforce_eager=True, **PLAIN)
    first = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stops = [o.outputs[0].token_ids[7] for o in first]
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]) for stop in stops]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    llm = _chained_llm(target, draft, after_verify=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want and llm.engine.runner.speculator.proposer.num_early > 0
    llm.engine.check_integrity()
