"""csrc/linear_avx2.cpp: float32 linear layers through 16-column weight panels (AVX2 + FMA builds), against a
float64 reference; outputs independent of the batch; model/linear.py packs for it wherever it builds (through
AVX-512 registers where the CPU has them, the same bits), and for oneDNN when LLMSERVE_CPU_LINEAR=onednn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model import cpu_kernels
from llmserve.model import linear as linear_mod
from llmserve.model.linear import Linear

needs_panels = pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="CPU kernels without AVX2 + FMA")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()  # [M, N]
    return out if b is None else out + b.double()


@needs_panels
@pytest.mark.parametrize("num_out,num_in", [(520, 384), (48, 1000), (7, 5)])  # 520, 7: a partial last panel
@pytest.mark.parametrize("has_bias", [False, True])
def test_panels_match_a_float64_reference_at_every_row_count(num_out, num_in, has_bias):
    gen = torch.Generator().manual_seed(num_out)
    w = torch.randn(num_out, num_in, generator=gen)
    b = torch.randn(num_out, generator=gen) if has_bias else None
    panels = cpu_kernels.pack_linear_weight(w)
    assert panels.shape == (-(-num_out // 16), num_in, 16)
    for rows in [1, 2, 5, 6, 7, 16, 63, 64, 65, 200]:  # every row-block size, and more than one 64-row unit
        x = torch.randn(rows, num_in, generator=gen)
        got = cpu_kernels.packed_linear(x, panels, num_out, b)
        torch.testing.assert_close(got.double(), _reference(x, w, b), atol=2e-6 * num_in ** 0.5, rtol=1e-5)


@needs_panels
@pytest.mark.parametrize("num_threads", [1, 2, 5])
@pytest.mark.parametrize("num_out,num_in", [(200, 300), (3000, 40)])  # 3000 x 40: many chunks, for threads to take
def test_a_rows_output_does_not_depend_on_the_batch_or_the_threads(num_threads, num_out, num_in):
    """Each output is one FMA chain over k in order: the same bits whatever the rows beside it, and whichever
    thread's chunk (csrc/balanced_for.h) its panel fell in."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(num_out, num_in, generator=gen), torch.randn(70, num_in, generator=gen)
    panels = cpu_kernels.pack_linear_weight(w)
    alone = torch.cat([cpu_kernels.packed_linear(x[i:i + 1], panels, num_out) for i in range(70)])
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        together = cpu_kernels.packed_linear(x, panels, num_out)
        shifted = cpu_kernels.packed_linear(x[3:], panels, num_out)
        single = [cpu_kernels.packed_linear(x[:1], panels, num_out) for _ in range(20)]
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone) and torch.equal(shifted, alone[3:])
    assert all(torch.equal(each, alone[:1]) for each in single)


@needs_panels
def test_bad_arguments_are_refused():
    panels = cpu_kernels.pack_linear_weight(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_kernels.packed_linear(torch.randn(3, 9), panels, 32)
    with pytest.raises(RuntimeError, match="ceil"):
        cpu_kernels.packed_linear(torch.randn(3, 8), panels, 48)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.packed_linear(torch.randn(3, 8), panels, 32, torch.randn(31))


@needs_panels
def test_linear_layers_are_packed_into_panels_without_avx512(pretend_cpu):
    pretend_cpu({"avx2", "fma"})  # LLMSERVE_CPU_LINEAR unset: the CPU's kind decides
    assert cpu_kernels.packs_linears()
    layer = Linear(384, 520).requires_grad_(False)
    w, b = layer.weight.clone(), layer.bias.clone()
    assert linear_mod.pack_linears(torch.nn.Sequential(layer)) == 1
    assert layer.packed_weight.shape == (33, 384, 16) and layer.weight is None
    x = torch.randn(2, 5, 384)  # leading dimensions are kept
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@needs_panels
def test_with_avx512_layers_are_packed_into_panels_too(pretend_cpu):
    """Panels stream a decode step's weights faster than oneDNN at decode sizes and match it at prefill sizes
    on AVX-512 machines as well (docs/benchmarks.md, "CPU batch 1")."""
    pretend_cpu({"avx2", "fma", "avx512f"})
    assert cpu_kernels.packs_linears()
    pretend_cpu({"avx2", "fma", "avx512f"}, cap="AVX2")
    assert cpu_kernels.packs_linears()


@pytest.mark.skipif(not linear_mod._has_packing(), reason="torch without oneDNN weight packing")
def test_onednn_is_chosen_by_name(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_LINEAR", "onednn")
    assert not cpu_kernels.packs_linears()
    layer = Linear(384, 520, bias=True).requires_grad_(False)
    w, b = layer.weight.clone(), layer.bias.clone()
    assert linear_mod.pack_linears(torch.nn.Sequential(layer)) == 1
    assert layer.packed_weight.dim() == 2  # oneDNN's layout, not panels
    with torch.inference_mode():
        for rows in [1, 16, 33]:
            x = torch.randn(rows, 384)
            torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
