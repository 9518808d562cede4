"""The engine on the Triton attention backend and through the decode-graph buffers: the same greedy
tokens as the torch backend (on CPU the kernel runs under Triton's interpreter, the graph buffers
eagerly; tests/gpu runs both for real)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.testing.maker import make_model  # noqa: E402
from llmserve.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes  # noqa: E402

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
