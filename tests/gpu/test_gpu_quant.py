"""Quantization on a CUDA device (marked gpu, skipped without one): the FP8 and int8 layers through
torch._scaled_mm / torch._int_mm against a float64 reference of their quantized operands, the engine's
greedy tokens in each format independent of batching (CUDA graphs on), and the FP8 KV cache doubling
the blocks of a bf16 one. First H100 run: docs/gpu.md, "Status"."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model
from llmserve.model.quant.linear import FP8_DTYPE, Fp8Linear, Int8Linear
from llmserve.model.quant.token_kinds import ALL_DECODE, ALL_PROMPT, StepKinds

from quant_cases import write_peaked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ENGINE = dict(device="cuda", max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=128,
              enable_prefix_caching=False)


def _is_hopper() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


def _reference(layer, x: torch.Tensor, qmax: float, is_fp8: bool) -> torch.Tensor:
    """The layer's own quantized operands (per-token scales computed in float32, as the layer does: a
    scale rounded otherwise moves an element across an FP8 step, 32 x scale near 448), multiplied in
    float64."""
    scale = (x.float().abs().amax(1, keepdim=True) / qmax).clamp(min=1e-12)
    xs = x.float() / scale
    q = xs.clamp(-qmax, qmax).to(FP8_DTYPE).double() if is_fp8 else torch.round(xs).double()
    return (q * scale.double()) @ layer.dequantized_weight().double().t()


LAYERS = {"int8": (Int8Linear, 127.0, False), "fp8": (Fp8Linear, 448.0, True)}


@pytest.mark.parametrize("fmt,rows", [("int8", 1), ("int8", 16), ("int8", 17), ("int8", 300),
                                      ("fp8", 1), ("fp8", 16), ("fp8", 300)])
def test_quantized_layer_on_cuda(fmt, rows):
    layer_cls, qmax, is_fp8 = LAYERS[fmt]
    if is_fp8 and not _is_hopper():
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    w = torch.randn(512, 256, device="cuda") * 0.05
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    layer = layer_cls.from_float(w, None)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(layer, x.float(), qmax, is_fp8), atol=2e-2, rtol=1e-2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("gpu-quant")), seed=5)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """Logits whose top token leads (plain random weights leave near-ties that FP8's rounding flips: 5 and
    6 of 8 sequences kept on the H100, 2026-11-27, once one-row steps took an FP8 GEMV and larger ones
    _scaled_mm; decode tokens now take one kernel whatever the batch: model/quant/token_kinds.py)."""
    return write_peaked(str(tmp_path_factory.mktemp("gpu-peaked")))


@pytest.mark.parametrize("fmt", [dict(quantization="int8"), dict(quantization="fp8"), dict(kv_cache_dtype="fp8"),
                                 dict(quantization="fp8", kv_cache_dtype="fp8")])
def test_greedy_batching_invariance(peaked, fmt):
    if not _is_hopper() and "fp8" in fmt.values():
        pytest.skip("FP8 needs compute capability >= 8.9")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 80))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(peaked, dtype="bfloat16", **ENGINE, **fmt)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    same = sum(a == b for a, b in zip(together, alone))
    assert same >= 7, (together, alone)  # bf16 near-ties may flip one


def test_fp8_kv_doubles_blocks(checkpoint):
    if not _is_hopper():
        pytest.skip("FP8 needs compute capability >= 8.9")
    blocks = {kv: LLM(checkpoint, dtype="bfloat16", device="cuda", max_model_len=256, kv_cache_memory="64MiB",
                      kv_cache_dtype=kv).engine.num_blocks for kv in ("auto", "fp8")}
    assert blocks["fp8"] == 2 * blocks["auto"]


@pytest.mark.parametrize("is_decode", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64, 300])
def test_fp8_triton_path_matches_torchs_ops(rows, is_decode):
    """Fp8Linear on CUDA (fp8_triton: its decode kernel for decode tokens, else its quantization kernel +
    _scaled_mm) against torch's own per-token quantization and _scaled_mm: the same FP8 operands, float32
    sums."""
    if not _is_hopper():
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    layer = Fp8Linear.from_float(torch.randn(4096, 1024, device="cuda") * 0.05, None)
    layer.step_kinds = StepKinds()
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    with layer.step_kinds.using(ALL_DECODE if is_decode else ALL_PROMPT):
        out = layer(x)
    torch.testing.assert_close(out.float(), layer.matmul_torch(x).float(), atol=2e-2, rtol=1e-2)
