"""The FP8 Triton kernels (model/quant/fp8_triton.py) against float64 references, on whatever device runs
them: compiled on CUDA, through Triton's interpreter on CPU.

The interpreter's float32 -> float8 conversion goes wrong where a value rounds up into the next power of
two (125.9 becomes 64, not 128), so the inputs here are chosen exactly representable after scaling:
every row's largest |x| is 448 x scale and every x / scale is an e4m3 value. The kernels' rounding of
other values is the GPU's own conversion, checked on CUDA by tests/gpu/test_gpu_quant.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without CUDA, conftest.py set TRITON_INTERPRET=1 before anything imported it

from llmserve.model.quant import fp8_triton  # noqa: E402
from llmserve.model.quant.linear import FP8_DTYPE, Fp8Linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _exact_rows(rows: int, k: int, gen: torch.Generator, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] whose per-row scale is a power of two and x / scale is exactly an e4m3 value."""
    q = (torch.randn(rows, k, generator=gen) * 60).clamp(-440, 440).to(FP8_DTYPE).float()
    q[:, 0] = 448.0 * torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0)  # the row's largest |x|
    scale = 2.0 ** torch.randint(-12, -4, (rows, 1), generator=gen).float()
    return (q * scale).to(dtype).to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("rows,k", [(1, 64), (3, 700), (5, 2048)])
def test_quantize_rows_gives_torchs_scales_and_values(rows, k):
    gen = torch.Generator().manual_seed(rows * k)
    x, scale = _exact_rows(rows, k, gen)
    q, got_scale = fp8_triton.quantize_rows(x)
    assert q.dtype == FP8_DTYPE and got_scale.shape == (rows, 1)
    torch.testing.assert_close(got_scale, scale, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), (x.float() / scale).to(FP8_DTYPE).float(), rtol=0, atol=0)


@pytest.mark.parametrize("rows,n,k", [(1, 40, 700), (2, 16, 256), (3, 100, 300), (4, 64, 1024)])
def test_fp8_gemv_is_the_fp8_product_in_float32(rows, n, k):
    gen = torch.Generator().manual_seed(rows + n + k)
    layer = Fp8Linear.from_float((torch.randn(n, k, generator=gen) * 0.05).to(DEVICE), None)
    x, scale = _exact_rows(rows, k, gen)
    got = fp8_triton.fp8_gemv(x, layer.weight, layer.scale.reshape(-1))
    assert got.dtype == x.dtype and got.shape == (rows, n)
    xq = (x.double() / scale.double())  # exact e4m3 values by construction
    ref = (xq @ layer.weight.double().t()) * scale.double() * layer.scale.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_rows_of_a_batch_do_not_change_each_other():
    """A row's output is the same alone and beside others (per-row scales, no cross-row reduction)."""
    gen = torch.Generator().manual_seed(9)
    layer = Fp8Linear.from_float((torch.randn(48, 320, generator=gen) * 0.05).to(DEVICE), None)
    x, _ = _exact_rows(4, 320, gen)
    together = fp8_triton.fp8_gemv(x, layer.weight, layer.scale.reshape(-1))
    alone = torch.cat([fp8_triton.fp8_gemv(x[i:i + 1], layer.weight, layer.scale.reshape(-1)) for i in range(4)])
    torch.testing.assert_close(together, alone, rtol=0, atol=0)
