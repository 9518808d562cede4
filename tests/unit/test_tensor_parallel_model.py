"""Tensor-parallel layers and sharded loading: 2 gloo ranks reproduce the whole model's logits.

The checkpoints cover the four dense architectures and the three MoE ones (every expert split; gpt-oss's sinks
and expert biases), Gemma 3, Phi-3's fused qkv_proj and gate_up_proj cut per rank, DeepSeek V3 and V2 (latent
attention's heads split, the latent cache whole on each rank, shared experts split), uneven splits (3 KV groups
over 2 ranks, an odd intermediate size, a vocabulary that does not divide by 2), replicated KV heads (1 KV head,
2 ranks), biases on every projection, and tied embeddings.
"""


import pytest
import torch
from gloo_ranks import run_ranks

from llmserve.testing.maker import SHAPES, Shape, make_model, write_checkpoint
from llmserve.model.parallel import check_tensor_parallel, head_shard, shard_layout, split_evenly

UNEVEN = Shape(48, 2, 6, 3, 99, 511, 512, init_std=0.1)  # 3 KV groups of 2 heads, head_dim 8
MQA_TIED = Shape(64, 2, 4, 1, 128, 512, 512, is_tied=True, init_std=0.1)  # 1 KV head: replicated


def _batch(vocab: int):
    from llmserve.testing.paged_batch import PagedBatchBuilder

    builder = PagedBatchBuilder(num_blocks=32, block_size=4, seed=0)
    gen = torch.Generator().manual_seed(0)
    rows = [(i, torch.randint(3, vocab, (n,), generator=gen).tolist()) for i, n in enumerate((7, 1, 12))]
    prefill = builder.step(rows)
    decode = builder.step([(i, [5 + i]) for i in range(3)])
    return [prefill, decode]


def _logits(path: str, tp=None) -> list[torch.Tensor]:
    """Logits of a prefill then a decode step of 3 requests (each step's last token per request)."""
    from llmserve.model.attn_torch import TorchAttentionBackend
    from llmserve.model.loader import load_model
    from llmserve.testing.paged_batch import allocate_kv_caches

    model = load_model(path, torch.float32, "cpu", tp=tp)
    if tp is not None and tp.is_expert_parallel:  # the rank holds its 4 of the 8 experts, and only them
        assert {block.experts.gate_up_proj.shape[0] for block in model.moe_blocks()} == {4}
        assert {block.is_all_to_all for block in model.moe_blocks()} == {tp.all2all_backend == "all2allv"}
    backend = TorchAttentionBackend()
    kv = allocate_kv_caches(model, 32, 4)
    out = []
    with torch.inference_mode():
        for input_ids, positions, attn in _batch(model.config.vocab_size):
            hidden = model(input_ids, positions, kv, backend.build_metadata(attn), backend)
            out.append(model.compute_logits(hidden[attn.query_start_loc[1:].long() - 1]))
    return out


def _rank_main(rank: int, size: int, port: int, runs: list[tuple[list[str], dict]], results) -> None:
    """Each run (checkpoints, TensorParallel settings) on this rank, one after another in one process group:
    (rank, [run][checkpoint][step] logits)."""
    import torch.distributed as dist

    from llmserve.model.parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        got = [[[t.tolist() for t in _logits(p, TensorParallel(rank, size, **parallel))] for p in paths]
               for paths, parallel in runs]
        results.put((rank, got))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("tp-model")
    paths = [make_model(arch, "tiny", str(root / arch), seed=3) for arch in ("llama", "mistral", "qwen2", "qwen3")]
    paths.append(write_checkpoint("qwen2", UNEVEN, str(root / "uneven"), seed=4))  # q/k/v biases
    paths.append(write_checkpoint("llama", MQA_TIED, str(root / "mqa-tied"), seed=5))
    paths += [make_model(arch, "tiny-moe", str(root / arch), seed=6) for arch in ("qwen3_moe", "mixtral")]
    paths.append(make_model("gpt_oss", "tiny-gpt-oss", str(root / "gpt_oss"), seed=6))
    paths.append(make_model("gemma3", "tiny-gemma3", str(root / "gemma3"), seed=6))
    paths.append(make_model("phi3", "tiny", str(root / "phi3"), seed=7))  # fused qkv_proj / gate_up_proj
    paths.append(write_checkpoint("phi3", UNEVEN, str(root / "phi3-uneven"), seed=8))  # fused, cut unevenly
    # latent attention: heads split, latents whole on each rank; routed and shared experts split
    paths += [make_model(arch, "tiny-deepseek-v3", str(root / arch), seed=9) for arch in ("deepseek_v3", "deepseek_v2")]
    return paths


MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "deepseek_v2")
ALL2ALL_BACKENDS = ("allgather_reducescatter", "all2allv")


@pytest.fixture(scope="module")
def ranked(checkpoints) -> dict[str | None, dict[int, list]]:
    """The tests' runs on one pair of spawned gloo ranks (a spawn costs each rank a torch import): every
    checkpoint split (key None), and the MoE ones under expert parallelism (key: the all2all backend) ->
    rank -> [checkpoint][step] logits."""
    moe = [path for path in checkpoints if path.endswith(MOE_ARCHS)]
    runs = {None: (checkpoints, {}),
            **{backend: (moe, {"is_expert_parallel": True, "all2all_backend": backend})
               for backend in ALL2ALL_BACKENDS}}
    got = dict(run_ranks(_rank_main, 2, lambda rank, port, results: (rank, 2, port, list(runs.values()), results),
                         timeout=240))
    return {key: {rank: got[rank][i] for rank in range(2)} for i, key in enumerate(runs)}


def _check_ranks(paths: list[str], got: dict[int, list]) -> None:
    for i, path in enumerate(paths):
        whole = _logits(path)
        for rank in range(2):
            for step, expected in zip(got[rank][i], whole):
                torch.testing.assert_close(torch.tensor(step), expected, atol=2e-5, rtol=1e-4,
                                           msg=lambda m: f"{path} rank {rank}: {m}")


def test_two_ranks_reproduce_the_whole_model(checkpoints, ranked):
    _check_ranks(checkpoints, ranked[None])


@pytest.mark.parametrize("all2all_backend", ALL2ALL_BACKENDS)
def test_two_ranks_holding_whole_experts_reproduce_the_whole_model(checkpoints, ranked, all2all_backend):
    """Expert parallelism: each rank reads and runs 4 of the 8 experts (per-expert checkpoint tensors for
    Qwen3-MoE, Mixtral and DeepSeek, stacked ones with biases for gpt-oss). DeepSeek's routing (grouped top-k,
    V3's sigmoid scores with the correction bias, routed_scaling_factor) runs whole on every rank, its shared
    experts split by features, its first_k_dense_replace layers dense and split, its latent attention's heads
    split as under tensor parallelism. all2allv: each rank sends its half of the tokens' routed rows to the
    experts' ranks and combines their outputs (model/moe_dispatch.py)."""
    moe = [path for path in checkpoints if path.endswith(MOE_ARCHS)]
    _check_ranks(moe, ranked[all2all_backend])


def test_heads_split_by_kv_group():
    assert [head_shard(9, 3, 2, r) for r in range(2)] == [((0, 6), (0, 2)), ((6, 3), (2, 1))]
    assert [head_shard(8, 2, 4, r) for r in range(4)] == [((0, 2), (0, 1)), ((2, 2), (0, 1)),
                                                          ((4, 2), (1, 1)), ((6, 2), (1, 1))]
    assert [split_evenly(99, 2, r) for r in range(2)] == [(0, 50), (50, 49)]
    with pytest.raises(ValueError, match="cannot split 6 attention heads over 2 KV heads"):
        head_shard(6, 2, 4, 0)  # 2 ranks per KV head, 3 query heads each: no even share


def test_smollm2_shape_splits_over_two_ranks():
    s = SHAPES["smollm2-135m"]
    config = type("C", (), dict(num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                                intermediate_size=s.intermediate_size, vocab_size=s.vocab_size,
                                hidden_size=s.hidden_size, head_dim=None))()
    check_tensor_parallel(config, 2)
    assert shard_layout(config, 2, 1).q_heads == (6, 3)


def test_deepseek_v3_shape_cuts_heads_and_shared_experts_and_keeps_the_latents_whole():
    from llmserve.model.parallel import shard_of
    from llmserve.testing.maker import build_config

    config = build_config("deepseek_v3", SHAPES["deepseek-v3"], "bfloat16")
    check_tensor_parallel(config, 8)
    layout = shard_layout(config, 8, 3)
    assert layout.q_heads == (48, 16) and layout.shared_intermediate == (768, 256)
    attn, mlp = "model.layers.5.self_attn", "model.layers.5.mlp"
    assert shard_of(f"{attn}.q_b_proj.weight", layout) == (0, 48 * 192, 16 * 192)  # qk_nope 128 + rope 64
    assert shard_of(f"{attn}.kv_b_proj.weight", layout) == (0, 48 * 256, 16 * 256)  # qk_nope 128 + v 128
    assert shard_of(f"{attn}.o_proj.weight", layout) == (1, 48 * 128, 16 * 128)
    for whole in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
        assert shard_of(f"{attn}.{whole}", layout) is None  # the latent path: the cache is whole on every rank
    assert shard_of(f"{mlp}.shared_experts.down_proj.weight", layout) == (1, 768, 256)
