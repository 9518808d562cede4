"""Penalties' tokens kept on the device give the penalties the host lists give."""

import random

import numpy as np

import torch

from llmserve.sample.metadata import build_sampling_metadata
from llmserve.sample.sampler import process_logits
from llmserve.sampling_params import SamplingParams
from llmserve.worker.input_batch import CachedRequestState
from llmserve.worker.penalty_tokens import PenaltyTokens
from llmserve.worker.persistent_batch import PersistentBatch

V = 40


def _state(i: int, rng: random.Random, batch: PersistentBatch) -> CachedRequestState:
    params = SamplingParams(repetition_penalty=[1.0, 1.3][i % 2], presence_penalty=[0.0, 0.4, 0.7][i % 3],
                            frequency_penalty=[0.0, 0.25][(i // 2) % 2])
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 12))]
    output = [rng.randrange(V) for _ in range(rng.randint(0, 6))]  # resumed after a preemption
    state = CachedRequestState(req_id=str(i), prompt_token_ids=prompt, params=params, generator=None, block_ids=[],
                               stop_token_ids_for_min_tokens=[], batch=batch)
    state.row = batch.add(state.req_id, prompt + output, [], state.has_penalties)
    return state


def test_device_tokens_give_the_host_penalties():
    rng = random.Random(0)
    batch = PersistentBatch(4, 64, 16)  # grows its rows as the states arrive
    states = [_state(i, rng, batch) for i in range(9)]
    tokens = PenaltyTokens(V, torch.device("cpu"))
    for state in states:
        if state.has_penalties:
            tokens.add(state)
    for step in range(5):
        rows = [s for s in states if rng.random() < 0.8]
        logits = torch.randn(len(rows), V)
        device_meta = build_sampling_metadata(rows, V, "cpu", with_penalties=False)
        device_meta.penalties = tokens.metadata(rows)
        host_meta = build_sampling_metadata(rows, V, "cpu")
        on_device, on_host = logits.clone(), logits.clone()
        process_logits(on_device, device_meta)
        process_logits(on_host, host_meta)
        assert torch.allclose(on_device, on_host), step
        sampled = torch.randint(0, V, (len(rows),))
        penalized = [j for j, s in enumerate(rows) if s.has_penalties]
        tokens.append_sampled(np.array([rows[j].row for j in penalized]), sampled[penalized])  # as the runner
        for j, state in enumerate(rows):
            batch.append_tokens(state.row, [int(sampled[j])])
    assert any(not s.has_penalties for s in states)  # rows without penalties are left out


def test_engine_serves_penalised_requests_past_the_buffers_first_sizes(tmp_path):
    """Buffers grown while sampling (inference mode) are written again when new requests arrive."""
    from llmserve import LLM, SamplingParams
    from llmserve.testing.maker import make_model

    llm = LLM(make_model("llama", "tiny", str(tmp_path / "m"), seed=0), dtype="float32", max_num_seqs=4, num_kv_blocks=1024)
    outputs = llm.generate([[5 + i] * (3 + i) for i in range(12)],
                           SamplingParams(max_tokens=40, repetition_penalty=1.2, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [40] * 12
    llm.engine.check_integrity()



def test_the_same_run_of_rows_reuses_its_metadata_and_sees_every_appended_id():
    """Rows that are one run of the batch: one metadata while they sample (its output ids a view of the buffer, so
    each step's appended ids are in it), a new one when the buffer grows or a row is added; the penalties equal the
    host lists' every step."""
    rng = random.Random(1)
    batch = PersistentBatch(4, 64, 16)
    states = [_state(i, rng, batch) for i in (1, 3, 5)]  # each with a penalty, in rows 0, 1, 2
    tokens = PenaltyTokens(V, torch.device("cpu"))
    for state in states:
        tokens.add(state)
    assert [s.row for s in states] == [0, 1, 2]
    metas = []
    for step in range(20):  # past the buffer's first 16 columns
        meta = tokens.metadata(states)
        metas.append(meta)
        host_meta = build_sampling_metadata(states, V, "cpu")
        device_meta = build_sampling_metadata(states, V, "cpu", with_penalties=False)
        device_meta.penalties = meta
        logits = torch.randn(len(states), V)
        on_device, on_host = logits.clone(), logits.clone()
        process_logits(on_device, device_meta)
        process_logits(on_host, host_meta)
        assert torch.allclose(on_device, on_host), step
        sampled = torch.randint(0, V, (len(states),))
        tokens.append_sampled(np.array([s.row for s in states]), sampled)
        for j, state in enumerate(states):
            batch.append_tokens(state.row, [int(sampled[j])])
    assert metas[1] is metas[0]  # reused while the rows stay
    assert len({id(m) for m in metas}) < len(metas) // 2  # rebuilt only when the columns grew
    new = _state(7, rng, batch)
    tokens.add(new)
    assert tokens.metadata(states) is not metas[-1]  # a row added: built again
