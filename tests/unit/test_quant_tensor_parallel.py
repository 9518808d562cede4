"""--quantization int8 / fp8 with --tensor-parallel-size 2 (model/quant/parallel.py): each rank's slices
quantized with their own scales, a row-parallel one keeping its all-reduce and its bias on rank 0 only, the
experts split or whole a rank; the logits of 2 gloo ranks within the method's bar of the float model, the same
on both ranks; the engine's tokens the same alone and in a batch. An FP8 checkpoint (block scales) on 2 ranks:
each rank dequantizes whole tensors and keeps its slices, giving one rank's logits."""

import types

import numpy as np
import pytest
import torch

from gloo_ranks import run_ranks
from lora_helpers import make_adapter

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.model.lora_layers import LoRAContext, LoRALinear, lora_step
from llmserve.model.moe import MoeSpec, SparseMoeBlock
from llmserve.model.quant.checkpoint import write_fp8_checkpoint
from llmserve.model.quant.experts import QuantizedExperts, quantize_model_experts
from llmserve.model.quant.linear import Int8Linear
from llmserve.model.quant.parallel import RowParallelQuantized
from llmserve.testing.maker import make_model
from test_quant import _agreement, _prefill_logits, _prompts
from test_quant_moe import MOE_THRESHOLDS

ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64, num_kv_blocks=200)


def _rank_main(rank: int, port: int, cases: list[tuple[str, bool, str | None]], results) -> None:
    """Every case (checkpoint, experts whole a rank, quantization) on this rank, one after another in one process
    group: (rank, [(layer kinds, prefill logits)] in the cases' order)."""
    import torch.distributed as dist

    from llmserve.model.loader import load_model
    from llmserve.model.parallel import TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        got = []
        for path, is_expert_parallel, method in cases:
            tp = TensorParallel(rank, 2, is_expert_parallel=is_expert_parallel)
            model = load_model(path, torch.float32, "cpu", tp=tp, quantization=method)
            layer = model.model.layers[1]
            kinds = (type(layer.self_attn.o_proj).__name__, type(getattr(layer.mlp, "experts", layer.mlp)).__name__,
                     type(model.lm_head).__name__ if model.lm_head is not None else None)
            got.append((kinds, _prefill_logits(model, _prompts(8, seed=2)).tolist()))
        results.put((rank, got))
    finally:
        dist.destroy_process_group()


QUANTIZED = [(is_expert_parallel, method) for is_expert_parallel in (False, True) for method in ("int8", "fp8")]
FP8_CHECKPOINTS = [("llama", "tiny"), ("qwen3_moe", "tiny-moe")]


@pytest.fixture(scope="module")
def ranked(tmp_path_factory) -> tuple[dict, dict[tuple, dict[int, tuple]]]:
    """Both tests' cases on one pair of spawned ranks (a spawn costs each rank a torch import): the paths, and
    case -> rank -> (layer kinds, logits); cases: (is_expert_parallel, method) of the peaked MoE model, and
    (arch, shape) of the FP8 checkpoints read unquantized."""
    root = tmp_path_factory.mktemp("quant-tp")
    paths = {"peaked": make_model("qwen3_moe", "tiny-moe", str(root / "peaked"), seed=3, is_peaked=True)}
    for arch, shape in FP8_CHECKPOINTS:
        paths[arch, shape] = make_model(arch, shape, str(root / arch), seed=3)
        write_fp8_checkpoint(paths[arch, shape], "fp8")
    cases = {**{case: (paths["peaked"], *case) for case in QUANTIZED},
             **{case: (paths[case], False, None) for case in FP8_CHECKPOINTS}}
    got = dict(run_ranks(_rank_main, 2, lambda rank, port, results: (rank, port, list(cases.values()), results)))
    return paths, {case: {rank: got[rank][i] for rank in range(2)} for i, case in enumerate(cases)}


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("is_expert_parallel", [False, True], ids=["experts-split", "experts-whole"])
def test_two_quantized_ranks_are_within_the_methods_bar_of_the_float_model(ranked, is_expert_parallel, method):
    from llmserve.model.loader import load_model

    paths, results = ranked
    got = results[is_expert_parallel, method]
    for rank in range(2):
        assert got[rank][0] == ("RowParallelQuantized", "QuantizedExperts", "Linear")  # the head: float
    assert got[0][1] == got[1][1]  # the all-reduces leave every rank the same logits
    ref = _prefill_logits(load_model(paths["peaked"], torch.float32, "cpu"), _prompts(8, seed=2))
    cos, top1 = _agreement(ref, torch.tensor(got[0][1]))
    min_cos, min_top1 = MOE_THRESHOLDS[method]
    assert cos >= min_cos and top1 >= min_top1, (cos, top1)


@pytest.mark.parametrize("arch, shape", FP8_CHECKPOINTS)
def test_two_ranks_cut_an_fp8_checkpoints_dequantized_weights_as_one_rank_reads_them(ranked, arch, shape):
    """Block scales (one 128 x 128 block covers a tiny weight whole) do not cut like the weight: each rank
    dequantizes whole tensors, then keeps its slice; unquantized afterwards, 2 ranks give one rank's logits."""
    from llmserve.model.loader import load_model

    paths, results = ranked
    got = results[arch, shape]
    ref = _prefill_logits(load_model(paths[arch, shape], torch.float32, "cpu"), _prompts(8, seed=2))
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(got[rank][1]), ref, atol=2e-5, rtol=1e-4)


def test_a_rank_after_the_first_leaves_the_biases_of_row_parallel_slices_to_rank_0():
    rank1 = types.SimpleNamespace(rank=1, size=2, all_reduce=lambda out: out)
    block = SparseMoeBlock(32, MoeSpec(4, 2, 16, is_renormalized=True, has_bias=True), tp=rank1)
    for param in block.parameters():
        param.data = torch.randn(param.shape) * 0.1
    assert quantize_model_experts(block, Int8Linear) == 1 and isinstance(block.experts, QuantizedExperts)
    assert all(layer.bias is not None for layer in block.experts.gate_up_proj)
    assert all(layer.bias is None for layer in block.experts.down_proj)


def test_a_row_parallel_quantized_slice_sums_its_partial_through_the_all_reduce():
    calls = []
    tp = types.SimpleNamespace(rank=0, all_reduce=lambda out: calls.append(out.shape) or out * 2)
    layer = Int8Linear.from_float(torch.randn(8, 16), torch.randn(8))
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(RowParallelQuantized(layer, tp)(x), layer(x) * 2)
    assert calls == [torch.Size([3, 8])]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_quantized_engine_on_two_ranks_gives_each_request_its_tokens_alone_and_in_a_batch(tmp_path, method):
    path = make_model("qwen3_moe", "tiny-moe", str(tmp_path), seed=1)
    prompts = _prompts(5, seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, tensor_parallel_size=2, quantization=method, **ENGINE) as llm:
        batched = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        alone = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
        assert batched == alone and all(len(tokens) == 8 for tokens in batched)
        llm.engine.check_integrity()


def test_a_lora_adds_its_share_to_a_quantized_row_parallel_slice_before_the_one_all_reduce():
    """The rank's quantized partial plus its share of x @ A^T @ B^T, then one all-reduce (not the LoRA added
    after it, which the other ranks' all-reduce would count again)."""
    calls = []
    tp = types.SimpleNamespace(rank=1, all_reduce=lambda out: calls.append(out.shape) or out * 2)
    layer = Int8Linear.from_float(torch.randn(8, 16), None)
    lora = LoRALinear(RowParallelQuantized(layer, tp), 16, [8], num_slots=1, max_rank=4, context=LoRAContext(),
                      dtype=torch.float32, device=torch.device("cpu"))
    a, b = torch.randn(4, 16), torch.randn(8, 4)
    lora.set_slot(0, [(a, b)])
    lora.context.step = lora_step(np.zeros(3, dtype=np.int64), torch.device("cpu"))
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(lora(x), (layer(x) + x @ a.T @ b.T) * 2, atol=1e-4, rtol=1e-4)
    assert calls == [torch.Size([3, 8])]


def test_adapters_on_two_int8_ranks_change_the_tokens_and_give_each_request_its_tokens_alone(tmp_path):
    """Not one int8 rank's tokens (the row-parallel slices' own scales move a random model's near-ties, with or
    without an adapter); the placement of the LoRA's share is checked exactly above."""
    path = make_model("llama", "tiny", str(tmp_path / "base"), seed=1)
    lora = LoRARequest("a", 1, make_adapter(path, str(tmp_path / "a"), seed=30, rank=8, alpha=16))
    prompts = _prompts(4, seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = [lora, None, lora, None]
    with LLM(path, tensor_parallel_size=2, quantization="int8", enable_lora=True, max_lora_rank=8, **ENGINE) as llm:
        batched = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, lora_request=requests)]
        alone = [list(llm.generate([p], params, lora_request=r)[0].outputs[0].token_ids)
                 for p, r in zip(prompts, requests)]
        base = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:1], params)]
        assert batched == alone and all(len(tokens) == 8 for tokens in batched)
        assert batched[0] != base[0]  # the adapter counts
        llm.engine.check_integrity()
