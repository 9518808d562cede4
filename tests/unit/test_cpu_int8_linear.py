"""csrc/int8_linear_avx2.cpp: int8 linear layers (per-row quantized activations, per-channel int8 weights)
with exact integer sums, for CPUs where oneDNN's s8 GEMM has no VNNI and saturates; against an exact
reference, independent of the batch; Int8Linear runs it where `packs_int8` says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model import cpu_kernels
from llmserve.model.quant.linear import Int8Linear

needs_kernel = pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="CPU kernels without AVX2")


def _reference(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The definition: x quantized per row as torch does it, integer sums (exact in float64 here), the scales
    applied in float32 in the layer's order."""
    x_scale = (x.abs().amax(1, keepdim=True) / 127.0).clamp(min=1e-12)  # [M, 1]
    acc = torch.round(x / x_scale).double() @ q.double().t()  # [M, N], integers below 2^53
    y = acc.float() * x_scale * w_scale
    return y if bias is None else y + bias


@needs_kernel
@pytest.mark.parametrize("num_out,num_in", [(520, 384), (48, 1001), (7, 5)])  # partial panels, odd K
@pytest.mark.parametrize("has_bias", [False, True])
def test_kernel_matches_the_exact_reference_at_every_row_count(num_out, num_in, has_bias):
    gen = torch.Generator().manual_seed(num_out)
    q = torch.randint(-127, 128, (num_out, num_in), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(num_out, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(num_out, generator=gen) if has_bias else None
    panels = cpu_kernels.pack_int8_weight(q)
    assert panels.shape == (-(-num_out // 16), -(-num_in // 2), 32)
    assert torch.equal(cpu_kernels.unpack_int8_weight(panels, num_out, num_in), q)
    for rows in [1, 2, 5, 6, 7, 16, 63, 64, 65, 200]:  # every row-block size, more than one 64-row unit
        x = torch.randn(rows, num_in, generator=gen) * 3
        got = cpu_kernels.int8_linear(x, panels, w_scale, num_out, bias)
        torch.testing.assert_close(got, _reference(x, q, w_scale, bias), atol=1e-5, rtol=1e-6)


@needs_kernel
def test_worst_case_products_are_summed_exactly():
    """Every pair of products at 2 * 127 * 127: an int16 pair sum would saturate (oneDNN's AVX2 s8 GEMM), the
    kernel's int32 lanes do not."""
    q = torch.full((16, 4096), 127, dtype=torch.int8)
    q[1] = -127
    x = torch.full((3, 4096), 2.5)
    x[2, 1::2] = -2.5
    got = cpu_kernels.int8_linear(x, cpu_kernels.pack_int8_weight(q), torch.ones(16), 16)
    torch.testing.assert_close(got, _reference(x, q, torch.ones(16), None), atol=0, rtol=1e-6)
    assert got[0, 0] == got[1, 0] == -got[0, 1] > 0.999 * 127 * 4096 * 2.5 and got[2, 0] == 0  # 127 * 127 * 4096 * scale


@needs_kernel
@pytest.mark.parametrize("num_threads", [1, 2, 5])
def test_a_rows_output_does_not_depend_on_the_batch_or_the_threads(num_threads):
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (200, 301), generator=gen, dtype=torch.int8)
    w_scale, x = torch.rand(200, generator=gen), torch.randn(70, 301, generator=gen)
    x[5] *= 100  # an outlier row: its scale is its own
    panels = cpu_kernels.pack_int8_weight(q)
    alone = torch.cat([cpu_kernels.int8_linear(x[i:i + 1], panels, w_scale, 200) for i in range(70)])
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        together = cpu_kernels.int8_linear(x, panels, w_scale, 200)
        shifted = cpu_kernels.int8_linear(x[3:], panels, w_scale, 200)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone) and torch.equal(shifted, alone[3:])


@needs_kernel
def test_bad_arguments_are_refused():
    panels = cpu_kernels.pack_int8_weight(torch.zeros(32, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_kernels.int8_linear(torch.randn(3, 10), panels, torch.ones(32), 32)
    with pytest.raises(RuntimeError, match="ceil"):
        cpu_kernels.int8_linear(torch.randn(3, 8), panels, torch.ones(48), 48)
    with pytest.raises(RuntimeError, match="w_scale"):
        cpu_kernels.int8_linear(torch.randn(3, 8), panels, torch.ones(31), 32)
    with pytest.raises(RuntimeError, match="int8 \\[N, K\\]"):
        cpu_kernels.pack_int8_weight(torch.zeros(4, 4))


@needs_kernel
@pytest.mark.parametrize("flags,cap,is_ours", [
    ({"avx2", "fma"}, None, True),  # AVX2 only: oneDNN would saturate
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, None, False),
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "AVX2", True),  # held below VNNI
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "avx512_core", True),
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "AVX512_CORE_BF16", False),
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "AVX2_VNNI", True),  # AVX-VNNI is another extension
    ({"avx2", "fma", "avx_vnni"}, "AVX2_VNNI", False),
    ({"avx2", "fma", "avx_vnni"}, None, False),
])
def test_the_kernel_serves_where_onednn_has_no_vnni(pretend_cpu, flags, cap, is_ours):
    pretend_cpu(flags, cap)
    assert cpu_kernels.packs_int8() is is_ours
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    layer = Int8Linear.from_float(w, b)
    assert (layer.panels is not None) is is_ours and (layer.weight_t is None) is is_ours
    if is_ours:  # (the other layout's numbers are test_quant's, on this machine's real oneDNN)
        x = torch.randn(2, 3, 24, generator=gen)
        assert (layer(x) - F.linear(x, w, b)).norm() < 0.02 * F.linear(x, w, b).norm()  # near the float layer
        x2 = x.reshape(-1, 24)  # and exactly the product of its own quantized operands
        expected = _reference(x2, layer.quantized_weight(), layer.scale, b).reshape(2, 3, 40)
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-6)
