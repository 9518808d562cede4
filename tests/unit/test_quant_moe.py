"""--quantization int8 / fp8 of Mixture-of-Experts models: every expert's matrices quantized per expert and
output channel (model/quant/experts.py), the logits within the dense quantization tests' bars against the
float model; FP8 MoE checkpoints: per-expert tensors load, stacked float8 experts are refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.model.loader import load_model, load_model_info
from llmserve.model.quant.experts import QuantizedExperts
from llmserve.model.quant.linear import FP8_DTYPE, Fp8Linear, Int8Linear
from llmserve.testing.maker import make_model
from test_quant import THRESHOLDS, _agreement, _prefill_logits, _prompts

LAYERS = {"int8": Int8Linear, "fp8": Fp8Linear}
# (mean logits cosine, top-1 agreement) against float32: int8 at the dense tests' bars; fp8 at the bar of
# their block-scaled checkpoint, as this small random MoE model is less peaked than theirs (measured on
# qwen3_moe tiny-moe: fp8 of the dense layers alone 0.994 / 0.94, with the experts too 0.994 / 0.93;
# tiny Mixtral and gpt-oss models fall below the bars with their dense layers alone quantized, so they are
# held to the block-level bar)
MOE_THRESHOLDS = {"int8": THRESHOLDS["int8"], "fp8": (0.99, 0.9)}
CASES = [("qwen3_moe", "tiny-moe"), ("mixtral", "tiny-moe"), ("gpt_oss", "tiny-gpt-oss")]  # gpt-oss: biases


@pytest.fixture(scope="module", params=CASES, ids=[arch for arch, _ in CASES])
def checkpoint(request, tmp_path_factory):
    arch, shape = request.param
    return make_model(arch, shape, str(tmp_path_factory.mktemp(arch)), seed=3, is_peaked=True)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_experts_of_a_block_near_the_float_block(checkpoint, method):
    """Each MoE block's quantized experts (the router in float: the same routing) against the float block: two
    quantized GEMMs in series, each at the dense layer's bar (test_quant: 1% int8, 5% fp8), so twice it;
    one scale per expert and output channel."""
    floats = load_model(checkpoint, torch.float32, "cpu").moe_blocks()
    blocks = load_model(checkpoint, torch.float32, "cpu", quantization=method).moe_blocks()
    assert blocks and all(isinstance(block.experts, QuantizedExperts) for block in blocks)
    experts, spec = blocks[0].experts, blocks[0].spec
    assert len(experts.gate_up_proj) == len(experts.down_proj) == spec.num_experts
    assert all(isinstance(layer, LAYERS[method]) for layer in [*experts.gate_up_proj, *experts.down_proj])
    assert experts.gate_up_proj[0].scale.numel() == 2 * spec.intermediate_size
    assert blocks[0].gate.weight.dtype == torch.float32  # the router stays in float
    # an expert's rows are its routed pairs: no step-token kinds (the CUDA decode kernel's row order) for them
    assert all(getattr(layer, "step_kinds", None) is None for layer in experts.gate_up_proj)
    x = torch.randn(24, floats[0].gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for quantized, float_block in zip(blocks, floats, strict=True):
            want = float_block(x)
            rel = (quantized(x) - want).norm() / want.norm()
            assert rel < (0.02 if method == "int8" else 0.1), rel


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_moe_model_logits_against_float32(tmp_path, method):
    path = make_model("qwen3_moe", "tiny-moe", str(tmp_path), seed=3, is_peaked=True)
    prompts = _prompts(8, seed=2)
    ref = _prefill_logits(load_model(path, torch.float32, "cpu"), prompts)
    model = load_model(path, torch.float32, "cpu", quantization=method)
    cos, top1 = _agreement(ref, _prefill_logits(model, prompts))
    min_cos, min_top1 = MOE_THRESHOLDS[method]
    assert cos >= min_cos and top1 >= min_top1, (cos, top1)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-channel"])
def test_fp8_moe_checkpoint_with_per_expert_tensors_loads(tmp_path, fmt):
    path = make_model("qwen3_moe", "tiny-moe", str(tmp_path / fmt), seed=3, is_peaked=True, quantization=fmt)
    stored = load_file(os.path.join(path, "model.safetensors"))
    expert_weight = next(name for name in stored if ".experts.0." in name and name.endswith("proj.weight"))
    assert stored[expert_weight].dtype == FP8_DTYPE
    info = load_model_info("m", path, torch.float32)
    assert info.quantization == "fp8"  # unset --quantization: the checkpoint's
    plain = load_model(path, torch.float32, "cpu", quantization=None)  # dequantized as it streams in
    model = load_model(path, torch.float32, "cpu", quantization=info.quantization)
    assert isinstance(model.moe_blocks()[0].experts, QuantizedExperts)
    prompts = _prompts(8, seed=4)
    cos, top1 = _agreement(_prefill_logits(plain, prompts), _prefill_logits(model, prompts))
    # block scales are requantized per channel at load: one more rounding (measured 0.988 / 0.895 here)
    min_cos, min_top1 = MOE_THRESHOLDS["fp8"] if fmt == "fp8-channel" else (0.98, 0.85)
    assert cos >= min_cos and top1 >= min_top1, (cos, top1)


def test_fp8_checkpoint_with_stacked_float8_experts_is_refused_naming_the_tensor(tmp_path):
    """transformers' fused MoE modules save [E, ...] expert tensors; stored in float8 they are refused at load."""
    path = make_model("gpt_oss", "tiny-gpt-oss", str(tmp_path / "m"), seed=3)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = next(n for n in tensors if n.endswith("mlp.experts.down_proj"))
    tensors[name] = tensors[name].to(FP8_DTYPE)
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"quantization_config\): tensor '.*mlp.experts.down_proj' is float8"):
        load_model(path, torch.float32, "cpu")


def test_an_int8_moe_engine_gives_each_request_its_greedy_tokens_alone_and_in_a_batch(tmp_path):
    """Through the engine (chunked prefill, a batch of mixed lengths): per-token activation scales and
    batch-invariant routing keep a request's tokens the same whatever it is batched with."""
    from llmserve import LLM, SamplingParams

    path = make_model("qwen3_moe", "tiny-moe", str(tmp_path), seed=3, is_peaked=True)
    prompts = _prompts(5, seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(path, dtype="float32", quantization="int8", max_model_len=128, num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=32)
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    alone = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
    assert batched == alone and all(len(tokens) == 8 for tokens in batched)
    llm.engine.check_integrity()
