"""The expert-load metric on the grouped-GEMM path in CUDA graphs (model/moe_load.py): a bf16 MoE block on
Hopper counts its tokens per expert inside a captured graph, and the reader reports them a take later without
waiting for the device."""

from __future__ import annotations

import pytest
import torch

from llmserve.model.moe import MoeSpec, SparseMoeBlock
from llmserve.model.moe_load import ExpertLoadReader

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_graphed_grouped_block_counts_its_expert_load():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM runs on compute capability 9.0 and up")
    torch.manual_seed(0)
    block = SparseMoeBlock(64, MoeSpec(8, 2, 32, is_renormalized=True)).cuda().bfloat16()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.2)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    assert block.runs_grouped_gemm(x)
    with torch.no_grad():
        block(x)  # warm-up: the counts exist before capture
        reader = ExpertLoadReader()
        reader.take([block.load])  # forget the warm-up; its copy is pending
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block(x)
        graph.replay()
        graph.replay()
    expected = block.load.counts.clone()  # two replays of the same 16 tokens
    assert int(expected.sum()) == 2 * 16 * 2
    torch.cuda.synchronize()  # the warm-up's copy has finished: the next take reads it and copies the replays'
    assert reader.take([block.load]) is not None  # the warm-up's figure
    assert int(block.load.counts.sum()) == 0  # taken: counting starts again
    torch.cuda.synchronize()
    balance = reader.take([block.load])  # the replays' counts, copied at the previous take
    assert balance == pytest.approx(float(expected.max()) / float(expected.double().mean()), rel=1e-6)
