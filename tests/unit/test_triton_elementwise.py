"""The fused CUDA elementwise kernels (model/triton_elementwise.py) against the torch code they replace in
model/layers.py, through Triton's interpreter off CUDA (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llmserve.model import triton_elementwise  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _norm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _rows(num_rows: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, hidden, generator=gen) * 3).to(dtype).to(DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the mean's summation order may move a value by one step of the 16-bit type; Triton's interpreter
        # truncates its casts to bfloat16 where CUDA rounds, two steps with the weight's product
        step = 2 ** -7 if DEVICE == "cuda" else 2 ** -5
        torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 200, 4096])  # 200: a row shorter than its power-of-two block
def test_rms_norm_is_layers_rms_norm(dtype, hidden):
    x = _rows(5, hidden, dtype, hidden)
    weight = _rows(1, hidden, dtype, 1)[0]
    _close(triton_elementwise.rms_norm(x, weight, EPS), _norm_reference(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_writes_the_sum_into_the_residual(dtype):
    x, residual = _rows(7, 256, dtype, 2), _rows(7, 256, dtype, 3)
    weight = _rows(1, 256, dtype, 4)[0]
    total = x + residual  # rounded to dtype, as the torch path adds
    normed, summed = triton_elementwise.add_rms_norm(x, residual.clone(), weight, EPS)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(summed, total)
    else:
        _close(summed, total)  # the interpreter's truncating cast
    _close(normed, _norm_reference(total, weight))


def test_rows_are_normed_alone_whatever_the_batch():
    x = _rows(9, 512, torch.bfloat16, 5)
    weight = _rows(1, 512, torch.bfloat16, 6)[0]
    batch = triton_elementwise.rms_norm(x, weight, EPS)
    for i in (0, 4, 8):
        assert torch.equal(triton_elementwise.rms_norm(x[i:i + 1], weight, EPS), batch[i:i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 1500])  # 1500: two column blocks, the second partial
def test_silu_mul_is_silu_of_gate_times_up(dtype, width):
    gate_up = _rows(3, 2 * width, dtype, width)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(triton_elementwise.silu_mul(gate_up), F.silu(gate) * up)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert triton_elementwise.rms_norm(x, torch.ones(64, device=DEVICE), EPS).shape == (0, 64)
    assert triton_elementwise.silu_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_a_strided_view_in_place_as_layers_does(dtype):
    """q and k as views of one fused qkv output (rows wider than the heads), head_dim 64 and 80."""
    for head_dim in (64, 80):
        qkv = _rows(6, 5 * head_dim, dtype, head_dim)  # 3 q/k heads, then 2 more columns of "v"
        qk = qkv[:, :3 * head_dim].view(6, 3, head_dim)
        gen = torch.Generator().manual_seed(head_dim)
        angles = torch.rand(6, 1, head_dim // 2, generator=gen) * 6
        cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
        per_op = _rotary_reference(qk, cos, sin)  # the torch code apply_rotary runs off the fused paths
        once = _rotary_reference(qk.float(), cos.float(), sin.float()).to(dtype)  # float32, rounded once
        v_before = qkv[:, 3 * head_dim:].clone()
        got = triton_elementwise.rotary_(qk, cos, sin)
        assert got.data_ptr() == qk.data_ptr() and torch.equal(qkv[:, 3 * head_dim:], v_before)
        if dtype == torch.float32:
            _close(got, once)
            continue
        # the kernel rounds each product as torch does; compiled for CUDA those roundings were seen to fold (an
        # H200 gave the values rounded once): each value is one of the two, to a step of the 16-bit type
        step = 2 ** -7 if DEVICE == "cuda" else 2 ** -5
        err = torch.minimum((got.float() - per_op.float()).abs(), (got.float() - once.float()).abs())
        assert (err <= step * once.float().abs() + step).all()


def _rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.clone().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
