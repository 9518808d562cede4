"""The Triton GEMV for a few 16-bit rows on CUDA (model/triton_gemv.py) and its switch (model/fused_cuda.py):
F.linear's result in float32 sums for any rows up to 16, output tiles and K parts, bias or none; a row's
bits the same alone and in any batch. On CUDA it runs compiled; elsewhere through Triton's interpreter, in
float16 (the interpreter multiplies bfloat16 in tl.dot wrongly: numpy has no bfloat16)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without CUDA, conftest.py set TRITON_INTERPRET=1 before anything imported it

from llmserve.model import fused_cuda, triton_elementwise  # noqa: E402
from llmserve.model.linear import Linear  # noqa: E402
from llmserve.model.triton_gemv import GEMV_TILING, GemvTiling, gemv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE.type != "cuda", reason="Triton's interpreter multiplies bfloat16 in tl.dot wrongly; runs on CUDA"))]
# Small tiles so that the interpreter's few programs still cover several output tiles and K parts.
SMALL = GemvTiling(block_n=16, block_k=32, num_stages=2, min_programs=24)


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    return x, weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,tiling,num_parts", [
    (1, 100, 300, SMALL, 4),  # 7 output tiles, the last one partial; K's last part short of a block
    (5, 70, 129, GemvTiling(block_n=16, block_k=32, min_programs=1), 1),  # one part, K past the last block
    (16, 33, 512, SMALL, 8),  # a whole row tile
    (3, 48, 700, GEMV_TILING, 1)])  # the default tiling: K past one block
def test_gemv_is_f_linear_with_float32_sums(rows, n, k, tiling, num_parts, dtype):
    assert tiling.split_k(n, k) == num_parts
    x, weight, bias = _operands(rows, n, k, dtype, rows + n + k)
    want = x.double() @ weight.double().t() + bias.double()
    for b, ref in ((bias, want), (None, want - bias.double())):
        got = gemv(x, weight, b, tiling)
        assert got.dtype == dtype and got.shape == (rows, n)
        # the sums in float32 in another order than the float64 reference, then one rounding to 16 bits
        torch.testing.assert_close(got.double(), ref, rtol=2 ** -9, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype):
    """Every row of a launch is a row of one 16-row tensor-core tile whatever the batch, so a row's sums are
    the same alone and beside others (greedy decoding of a few users does not depend on who else runs)."""
    x, weight, _ = _operands(16, 70, 300, dtype, 4)
    full = gemv(x, weight, None, SMALL)
    for lo, hi in [(0, 1), (0, 5), (3, 4), (7, 16)]:
        torch.testing.assert_close(gemv(x[lo:hi], weight, None, SMALL), full[lo:hi], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", [SMALL, GEMV_TILING], ids=["split", "default"])
def test_the_gated_load_is_silu_mul_then_the_gemv(dtype, tiling):
    """gate_up [M, 2K] read as silu(gate) * up: the bits of triton_elementwise.silu_mul's output through the GEMV."""
    x, weight, bias = _operands(5, 70, 300, dtype, 7)
    gate_up = torch.cat([x, x.flip(1) * 0.5], dim=1)  # [5, 600]
    unfused = gemv(triton_elementwise.silu_mul(gate_up), weight, bias, tiling)
    torch.testing.assert_close(gemv(gate_up, weight, bias, tiling, is_gated=True), unfused, rtol=0, atol=0)
    gate, up = gate_up.double().split(300, dim=1)
    want = (gate * gate.sigmoid() * up) @ weight.double().t() + bias.double()
    torch.testing.assert_close(unfused.double(), want, rtol=2 ** -7, atol=1e-2)


def test_a_plain_down_projection_takes_the_gated_gemv(monkeypatch):
    """fused_cuda.gated_down: a plain Linear's rows through the gated GEMV; a subclass (row-parallel, whose
    forward all-reduces) or another module (LoRA, quantized) keeps silu_mul and its own forward."""
    monkeypatch.setenv("LLMSERVE_CUDA_GEMV_ROWS", "16")
    fused_cuda.cuda_gemv_rows.cache_clear()
    try:
        down = Linear(300, 70, bias=False).to(DEVICE, torch.float16).requires_grad_(False)
        gate_up = torch.randn(3, 600, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.float16)
        out = fused_cuda.gated_down(gate_up, down)
        assert out is not None
        torch.testing.assert_close(out, gemv(triton_elementwise.silu_mul(gate_up), down.weight), rtol=0, atol=0)
        subclass = type("RowParallelLike", (Linear,), {})(300, 70, bias=False).to(DEVICE, torch.float16)
        assert fused_cuda.gated_down(gate_up, subclass.requires_grad_(False)) is None
        assert fused_cuda.gated_down(torch.randn(17, 600).to(DEVICE, torch.float16), down) is None  # 17 rows
    finally:
        fused_cuda.cuda_gemv_rows.cache_clear()


def test_split_k_only_where_output_tiles_are_few():
    """The default tiling: no layer of the Llama-3.1-8B shape splits (a split is a second launch); a 1B's
    2,048-wide output does."""
    tiling = GemvTiling()  # 16 output channels a tile, at least 256 programs
    assert [tiling.split_k(n, k) for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                              (128256, 4096)]] == [1, 1, 1, 1, 1]  # qkv, o, gate_up, down, head
    assert tiling.split_k(2048, 2048) == 2  # Llama-3.2-1B's o_proj and down's output: 128 tiles


@pytest.mark.parametrize("value,rows", [("0", 0), ("4", 4), ("16", 16)])
def test_the_switch_reads_a_row_count(monkeypatch, value, rows):
    monkeypatch.setenv("LLMSERVE_CUDA_GEMV_ROWS", value)
    fused_cuda.cuda_gemv_rows.cache_clear()
    try:
        assert fused_cuda.cuda_gemv_rows() == rows
        x = torch.zeros(4, 8, dtype=torch.bfloat16)
        assert (fused_cuda.cuda_gemv(x, torch.zeros(3, 8, dtype=torch.bfloat16)) is not None) == (rows >= 4)
        assert fused_cuda.cuda_gemv(x, torch.zeros(3, 8)) is None  # a float32 weight: cuBLAS
        assert fused_cuda.cuda_gemv(x.float(), torch.zeros(3, 8)) is None
    finally:
        fused_cuda.cuda_gemv_rows.cache_clear()


@pytest.mark.parametrize("value", ["17", "-1", "yes", ""])
def test_a_row_count_out_of_range_is_refused(monkeypatch, value):
    monkeypatch.setenv("LLMSERVE_CUDA_GEMV_ROWS", value)
    fused_cuda.cuda_gemv_rows.cache_clear()
    try:
        with pytest.raises(ValueError, match="LLMSERVE_CUDA_GEMV_ROWS"):
            fused_cuda.cuda_gemv_rows()
    finally:
        fused_cuda.cuda_gemv_rows.cache_clear()
