"""model/linear.py: float32 CPU inference on large enough weights goes through oneDNN and matches F.linear; the
rest keeps F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model import cpu_kernels
from llmserve.model import linear as linear_mod
from llmserve.model.linear import Linear, linear, uses_onednn
from llmserve.model.parallel import column_linear, row_linear

needs_onednn = pytest.mark.skipif(not linear_mod._has_onednn(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 16, 33, 300])
@pytest.mark.parametrize("has_bias", [False, True])
def test_onednn_matches_f_linear(rows, has_bias):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 384, generator=gen), torch.randn(512, 384, generator=gen)
    b = torch.randn(512, generator=gen) if has_bias else None
    with torch.inference_mode():
        assert uses_onednn(x, w)
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_row_buckets_bound_the_primitives_and_waste_little():
    buckets = {linear_mod.bucket_rows(n) for n in range(1, 4097)}
    assert len(buckets) <= 128
    for n in range(1, 4097):
        padded = linear_mod.bucket_rows(n)
        assert padded == n if n <= linear_mod.EXACT_ROWS else n <= padded < n + max(8, n / 16)


def test_other_dtypes_ranks_and_autograd_keep_f_linear(monkeypatch):
    """(bfloat16 rows past the GEMV's 8 included: test_cpu_bf16.py has the rows under it.)"""
    cpu_kernels.available()  # loaded (and self-tested against F.linear) before F.linear is replaced
    calls = []
    monkeypatch.setattr(linear_mod.F, "linear", lambda *a: calls.append(a) or torch.zeros(()))
    w = torch.randn(512, 256)
    for x, weight in [(torch.randn(9, 256, dtype=torch.bfloat16), w.bfloat16()), (torch.randn(3, 2, 256), w),
                      (torch.randn(2, 256), w.clone().requires_grad_()), (torch.randn(2, 4), torch.randn(8, 4))]:
        assert not uses_onednn(x, weight)
        linear(x, weight)
    assert len(calls) == 4


def test_model_layers_are_linear_subclasses():
    """Quantization swaps every nn.Linear: the layers stay nn.Linear subclasses through `linear`."""
    assert isinstance(column_linear(4, 8, False, None), Linear)
    assert isinstance(row_linear(4, 8, True, None), torch.nn.Linear)


needs_packing = pytest.mark.skipif(not linear_mod._has_packing(), reason="torch without oneDNN weight packing")


@needs_packing
@pytest.mark.parametrize("has_bias", [False, True])
def test_a_packed_linear_matches_f_linear_at_every_row_count_and_keeps_one_copy(has_bias):
    gen = torch.Generator().manual_seed(7)
    layer = Linear(384, 520, bias=has_bias).requires_grad_(False)
    torch.nn.init.normal_(layer.weight, generator=gen)
    w, b = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    assert linear_mod.pack_linears(torch.nn.Sequential(layer)) == 1
    assert layer.weight is None and [n for n, _ in layer.named_parameters()] == (["bias"] if has_bias else [])
    with torch.inference_mode():
        for rows in [1, 3, 16, 17, 33, 300]:
            x = torch.randn(rows, 384, generator=gen)
            torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        x = torch.randn(2, 5, 384, generator=gen)  # leading dimensions are kept
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_only_large_float32_cpu_weights_without_grad_are_packed():
    small, bf16, trained = Linear(64, 64), Linear(512, 512).bfloat16(), Linear(512, 512)
    for layer in (small, bf16):
        layer.requires_grad_(False)
    assert linear_mod.pack_linears(torch.nn.Sequential(small, bf16, trained)) == 0
    assert all(layer.packed_weight is None and layer.weight is not None for layer in (small, bf16, trained))


def test_a_loaded_cpu_model_is_packed_and_generates_what_the_unpacked_one_does(tmp_path, monkeypatch,
                                                                               cpu_linear_path):
    from llmserve import LLM, SamplingParams
    from llmserve.testing.maker import make_model

    path = make_model("llama", "demo", str(tmp_path), seed=3)  # its MLP weights are large enough to pack
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(10, 50))]
    packed = LLM(path, dtype="float32", num_kv_blocks=1024)
    layouts = {m.packed_weight.dim() for m in packed.engine.runner.model.modules()
               if isinstance(m, Linear) and m.packed_weight is not None}
    assert layouts == {3 if cpu_linear_path == "panels" else 2}  # our panels [P, in, 16], or oneDNN's [out, in]
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    monkeypatch.setattr(Linear, "pack", lambda self: False)
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", num_kv_blocks=1024).generate(prompts, params)]
    assert got == want


def test_a_tied_lm_head_gets_a_packed_copy_with_the_same_logits_and_weight_counts(cpu_linear_path):
    """The embedding lookup keeps the plain table; the logits go through a packed copy, which the weight
    counts (threads, roofline bytes) do not count twice."""
    from dataclasses import replace

    from llmserve.bench.roofline import weight_bytes_read
    from llmserve.model.llama import CausalLM
    from llmserve.testing.maker import SHAPES, build_config
    from llmserve.worker.cpu_threads import num_matmul_params

    config = build_config("llama", replace(SHAPES["demo"], is_tied=True), "float32")
    model = CausalLM(config).eval().requires_grad_(False)
    hidden = torch.randn(5, config.hidden_size)
    want = model.compute_logits(hidden)
    counts = (num_matmul_params(model), weight_bytes_read(model))
    assert linear_mod.pack_linears(model) > 0 and model.tied_head_packed is not None
    assert model.tied_head_packed.dim() == (3 if cpu_linear_path == "panels" else 2)
    torch.testing.assert_close(model.compute_logits(hidden), want, rtol=1e-5, atol=1e-5)
    assert (num_matmul_params(model), weight_bytes_read(model)) == counts
    assert model.model.embed_tokens.weight is not None  # the lookup's table stays


def test_the_linear_path_switch_is_read_and_checked(monkeypatch):
    """LLMSERVE_CPU_LINEAR forces either path; an unknown value is refused, never ignored."""
    from llmserve.model import cpu_isa, cpu_kernels

    monkeypatch.setenv(cpu_isa.LINEAR_ENV, "onednn")
    assert not cpu_kernels.packs_linears()
    monkeypatch.setenv(cpu_isa.LINEAR_ENV, "panels")
    if cpu_kernels.has_avx2_kernels():
        assert cpu_kernels.packs_linears()
    else:
        with pytest.raises(ValueError, match="LLMSERVE_CPU_LINEAR=panels needs the AVX2 CPU kernels"):
            cpu_kernels.packs_linears()
    monkeypatch.setenv(cpu_isa.LINEAR_ENV, "fast")
    with pytest.raises(ValueError, match="LLMSERVE_CPU_LINEAR='fast': choose one of auto, panels, onednn"):
        cpu_kernels.packs_linears()

