"""Expert parallelism's pieces (model/moe_parallel.py): which experts a rank holds, which checkpoint tensors it
reads, and that the ranks' partial MoE outputs sum to the whole block's; the flag's checks. The 2-rank gloo
runs are in test_tensor_parallel_model.py and test_tensor_parallel_engine.py."""

from __future__ import annotations

import pytest
import torch

from llmserve.config import EngineConfig, ParallelConfig
from llmserve.model.loader import load_hf_config
from llmserve.model.moe import MoeSpec, SparseMoeBlock
from llmserve.model.moe_parallel import expert_range, expert_slice_of, is_held, local_expert_ids, to_local_experts
from llmserve.model.parallel import check_tensor_parallel, shard_layout
from llmserve.testing.maker import make_model

HIDDEN, INTER, EXPERTS = 32, 16, 8


def test_experts_go_to_ranks_in_contiguous_runs():
    assert [expert_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [expert_range(8, 3, r) for r in range(3)] == [(0, 3), (3, 3), (6, 2)]  # the first E mod N: one more
    with pytest.raises(ValueError, match="--enable-expert-parallel: 2 experts cannot go to 4 ranks"):
        expert_range(2, 4, 0)


def test_a_rank_reads_only_its_experts_tensors():
    held = (4, 4)
    assert is_held("model.layers.1.mlp.experts.5.gate_proj.weight", held)
    assert not is_held("model.layers.1.block_sparse_moe.experts.3.w2.weight", held)
    assert is_held("model.layers.1.mlp.gate.weight", held)  # the router: every rank
    assert is_held("model.layers.1.self_attn.q_proj.weight", held)
    assert expert_slice_of("model.layers.1.mlp.experts.5.down_proj.weight", (0, INTER), held) is None  # whole
    assert expert_slice_of("model.layers.1.mlp.experts.gate_up_proj", (0, INTER), held) == (0, 4, 4)  # [E, ...]
    assert expert_slice_of("model.layers.1.mlp.experts.down_proj_bias", (0, INTER), held) == (0, 4, 4)
    names = ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.6.up_proj.weight",
             "model.layers.0.mlp.gate.weight"]
    renamed = [name for name, _ in to_local_experts(((n, torch.zeros(1)) for n in names), held)]
    assert renamed == ["model.layers.0.mlp.experts.2.up_proj.weight", "model.layers.0.mlp.gate.weight"]


def test_pairs_of_other_ranks_experts_get_one_past_the_last_local_id():
    ids = torch.tensor([[0, 5], [7, 4], [3, 6]])
    assert local_expert_ids(ids, (4, 3)).tolist() == [[3, 1], [3, 0], [3, 2]]


def _block(held: tuple[int, int] | None, spec: MoeSpec) -> SparseMoeBlock:
    return SparseMoeBlock(HIDDEN, spec, held_experts=held)


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("has_bias", [False, True])
def test_the_ranks_partial_outputs_sum_to_the_whole_block(num_ranks, has_bias):
    """Each rank's block holds its experts' rows of the whole block's weights; their outputs summed (what the
    all-reduce does) equal the whole block's, biases included (each expert's on its rank only)."""
    spec = MoeSpec(EXPERTS, 2, INTER, is_renormalized=True, has_bias=has_bias)
    whole = _block(None, spec)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in whole.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    x = torch.randn(11, HIDDEN, generator=gen)
    total = torch.zeros(11, HIDDEN)
    with torch.no_grad():
        for rank in range(num_ranks):
            first, count = held = expert_range(EXPERTS, num_ranks, rank)
            part = _block(held, spec)
            part.gate.load_state_dict(whole.gate.state_dict())
            for name, param in part.experts.named_parameters():
                param.copy_(getattr(whole.experts, name)[first:first + count])
            total += part(x)
        torch.testing.assert_close(total, whole(x), atol=1e-5, rtol=1e-5)


def test_the_flag_is_checked_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match="--enable-expert-parallel: needs --tensor-parallel-size 2 or more"):
        EngineConfig(parallel=ParallelConfig(enable_expert_parallel=True)).validate()
    with pytest.raises(ValueError, match="--all2all-backend: all2allv dispatches .* needs --enable-expert-parallel"):
        EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, all2all_backend="all2allv")).validate()
    with pytest.raises(ValueError, match="all2all-backend"):
        EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True,
                                             all2all_backend="deepep_low_latency")).validate()
    dense = load_hf_config(make_model("llama", "tiny", str(tmp_path / "dense")))
    with pytest.raises(ValueError, match="--enable-expert-parallel: LlamaForCausalLM is not a Mixture-of-Experts"):
        check_tensor_parallel(dense, 2, is_expert_parallel=True)
    moe = load_hf_config(make_model("qwen3_moe", "tiny-moe", str(tmp_path / "moe")))
    check_tensor_parallel(moe, 2, is_expert_parallel=True)
    layout = shard_layout(moe, 2, 1, is_expert_parallel=True)
    assert layout.experts == (4, 4) and layout.expert_intermediate == (0, moe.moe_intermediate_size)
    deepseek = load_hf_config(make_model("deepseek_v3", "tiny-deepseek-v3", str(tmp_path / "ds")))
    check_tensor_parallel(deepseek, 2, is_expert_parallel=True)
    layout = shard_layout(deepseek, 2, 1, is_expert_parallel=True)  # routed experts whole, shared ones split
    assert layout.experts == (4, 4) and layout.expert_intermediate == (0, 32) and layout.shared_intermediate == (16, 16)
