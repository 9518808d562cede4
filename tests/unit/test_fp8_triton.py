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


# Small tiles so that the interpreter's few programs still cover several row groups, output tiles and K parts.
SMALL = fp8_triton.DecodeTiling(block_n=32, block_k=64, num_warps=4, num_stages=2, max_row_tiles=2, min_programs=32)
# The 64-row kind (one 2-D dot a program: wgmma on Hopper), as small.
WIDE = fp8_triton.DecodeTiling(block_n=32, block_k=64, num_warps=4, num_stages=2, max_row_tiles=1, min_programs=32,
                               row_tile=64)


def _layer(n: int, k: int, gen: torch.Generator) -> Fp8Linear:
    return Fp8Linear.from_float((torch.randn(n, k, generator=gen) * 0.05).to(DEVICE), None)


@pytest.mark.parametrize("tiling", [SMALL, WIDE], ids=["16-row", "64-row"])
@pytest.mark.parametrize("rows,n,k", [(1, 40, 700), (3, 100, 300), (20, 64, 1024), (70, 70, 130)])
def test_decode_matmul_is_the_fp8_product_in_float32(rows, n, k, tiling):
    gen = torch.Generator().manual_seed(rows + n + k)
    layer = _layer(n, k, gen)
    x, scale = _exact_rows(rows, k, gen, torch.float32)
    got = fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1), tiling)
    assert got.dtype == x.dtype and got.shape == (rows, n)
    xq = (x.double() / scale.double())  # exact e4m3 values by construction
    ref = (xq @ layer.weight.double().t()) * scale.double() * layer.scale.double()
    if tiling.row_tile == 64 and DEVICE == "cuda":
        # Hopper's FP8 wgmma accumulates in less than float32 (about 14 mantissa bits: the DeepSeek-V3 report);
        # measured on an H200: up to 3.7e-4 off here
        torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=2e-3)
    else:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)  # float32 sums of exact products


def test_decode_matmul_rounds_to_the_input_dtype():
    gen = torch.Generator().manual_seed(3)
    layer = _layer(48, 256, gen)
    x, _ = _exact_rows(5, 256, gen)  # bfloat16
    got = fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1), SMALL)
    full = fp8_triton.fp8_decode_matmul(x.float(), layer.weight, layer.scale.reshape(-1), SMALL)
    assert got.dtype == torch.bfloat16  # within one bfloat16 step (the interpreter's cast may truncate)
    torch.testing.assert_close(got.float(), full, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("k", [64, 512])  # K in one part; K split in parts (the reduction writes the slice)
def test_decode_matmul_writes_into_a_slice_of_a_larger_output(k):
    gen = torch.Generator().manual_seed(k)
    layer = _layer(40, k, gen)
    x = torch.randn(5, k, generator=gen).to(DEVICE)
    assert (SMALL.split_k(40, k) > 1) == (k == 512)
    want = fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1), SMALL)
    out = torch.full((8, 40), -7.0, device=DEVICE)
    got = fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1), SMALL, out=out[2:7])
    assert got.data_ptr() == out[2:7].data_ptr()
    torch.testing.assert_close(out[2:7], want, rtol=0, atol=0)
    assert (out[:2] == -7).all() and (out[7:] == -7).all()


@pytest.mark.parametrize("tiling", [SMALL, fp8_triton.DecodeTiling(block_n=16, block_k=32, max_row_tiles=1,
                                                                   min_programs=1), WIDE])
def test_a_rows_sums_do_not_depend_on_the_batch(tiling):
    """A row's bits are the same alone and in batches of other sizes (other row groups, row tiles a program,
    programs): what keeps greedy decoding independent of the batch (any x; no exactness needed). Rows
    keep their place in a row tile here: under the interpreter tl.dot is numpy's BLAS, whose sums at
    a tile's edge rows differ in the last bit; the tensor cores compute every row of a tile alike, which
    this test checks at any offset on CUDA (and tests/gpu/test_gpu_quant.py in a model)."""
    gen = torch.Generator().manual_seed(9)
    layer = _layer(70, 300, gen)
    x = torch.randn(100, 300, generator=gen).to(DEVICE)
    full = fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1), tiling)
    offset, tile = (0 if DEVICE == "cpu" else 5), tiling.row_tile
    for lo, hi in [(0, 1), (tile, tile + 1), (64, 70), (0, 17), (tile + offset, tile + 24), (offset, 100)]:
        part = fp8_triton.fp8_decode_matmul(x[lo:hi], layer.weight, layer.scale.reshape(-1), tiling)
        torch.testing.assert_close(part, full[lo:hi], rtol=0, atol=0)


def test_split_k_depends_on_the_weight_only():
    tiling = fp8_triton.DecodeTiling()  # the default: 64 output channels a tile, at least 264 programs
    assert tiling.split_k(28672, 4096) == 1  # gate_up: 448 tiles
    assert tiling.split_k(6144, 4096) == 4  # qkv: 96 tiles
    assert tiling.split_k(4096, 14336) == 8  # down: 64 tiles
    assert tiling.split_k(64, 256) == 1  # K of two blocks: nothing to split
