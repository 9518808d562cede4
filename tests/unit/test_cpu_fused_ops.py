"""The fused elementwise CPU ops (csrc/fused_ops.cpp through llmserve.model.cpu_kernels) against float64
references and the torch chains they replace in the model's layers."""

from __future__ import annotations

import pytest
import torch

from llmserve.model import cpu_kernels
from llmserve.model.attention import write_kv
from llmserve.model.layers import GatedMLP, RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="the C++ CPU kernels could not be built here (no compiler/ninja?)")

EPS = 1e-5


def _rms_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return (weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)).float()


@pytest.mark.parametrize("num_rows, hidden", [(1, 576), (16, 576), (600, 576), (5, 20)])
def test_rms_norm_matches_reference(num_rows, hidden):
    gen = torch.Generator().manual_seed(num_rows)
    x, weight = torch.randn(num_rows, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, EPS), _rms_reference(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_rows", [3, 600])
def test_add_rms_norm_works_in_place(num_rows):
    gen = torch.Generator().manual_seed(1)
    x, residual, weight = (torch.randn(num_rows, 64, generator=gen) for _ in range(3))
    weight = weight[0]
    expected_sum = x + residual
    cpu_kernels.add_rms_norm_(x, residual, weight, EPS)
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(x, _rms_reference(expected_sum, weight), atol=1e-5, rtol=1e-5)


def test_rows_do_not_depend_on_the_batch():
    """Each row is computed the same way alone or among 600 rows (threads split rows, never a row)."""
    gen = torch.Generator().manual_seed(2)
    x, weight, gate_up = torch.randn(600, 576, generator=gen), torch.randn(576, generator=gen), torch.randn(600, 3072, generator=gen)
    assert torch.equal(cpu_kernels.rms_norm(x[:1].clone(), weight, EPS), cpu_kernels.rms_norm(x, weight, EPS)[:1])
    assert torch.equal(cpu_kernels.silu_mul(gate_up[7:8].clone()), cpu_kernels.silu_mul(gate_up)[7:8])


@pytest.mark.parametrize("num_rows, inter", [(16, 1536), (300, 1536), (3, 13)])
def test_silu_mul_matches_reference(num_rows, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(num_rows, 2 * inter, generator=gen) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp(-g) past float32's range either way
    g64, u64 = gate_up.double().split(inter, dim=-1)
    expected = (g64 * torch.sigmoid(g64) * u64).float()
    out = cpu_kernels.silu_mul(gate_up)
    assert out.shape == (num_rows, inter) and torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rotary_rotates_a_strided_view_in_place_and_nothing_else():
    gen = torch.Generator().manual_seed(3)
    num_tokens, heads, kv_heads, dim = 7, 4, 2, 16
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, dim, generator=gen)
    angles = torch.randn(num_tokens, 1, dim // 2, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    before = qkv.clone()
    x1, x2 = before[:, :heads + kv_heads].chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    cpu_kernels.rotary_(qkv[:, :heads + kv_heads], cos, sin)
    torch.testing.assert_close(qkv[:, :heads + kv_heads], expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, heads + kv_heads:], before[:, heads + kv_heads:])  # v heads untouched


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_write_kv_matches_index_copy(cache_dtype):
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 3 + 2 * 2, 8, generator=gen)
    k, v = qkv[:, 3:5], qkv[:, 5:]  # strided views, as the model hands them over
    slots = torch.tensor([9, 0, 33, 4, 17])
    cache = torch.randn(2, 6, 8, 2, 8, generator=gen).to(cache_dtype)
    expected = cache.clone()
    expected[0].view(-1, 2, 8).index_copy_(0, slots, k.to(cache_dtype))
    expected[1].view(-1, 2, 8).index_copy_(0, slots, v.to(cache_dtype))
    cpu_kernels.write_kv(cache, slots, k, v)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.write_kv(cache, torch.tensor([0, 1, 2, 3, 48]), k, v)


def test_can_fuse_only_plain_float32_or_bfloat16_cpu_inference():
    x = torch.randn(2, 8)
    with torch.inference_mode():
        assert cpu_kernels.can_fuse(x) and cpu_kernels.can_fuse(x.bfloat16())
        assert not cpu_kernels.can_fuse(x.half())
    assert not cpu_kernels.can_fuse(x)  # autograd on: the torch ops


def _unfused(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "can_fuse", lambda x: False)
        return fn()


def test_layers_take_the_fused_ops_and_match_their_torch_chains(monkeypatch):
    torch.manual_seed(5)
    norm, mlp = RMSNorm(576, EPS), GatedMLP(576, 1536)
    norm.weight.data.normal_()
    x, residual = torch.randn(16, 576), torch.randn(16, 576)
    qk, angles = torch.randn(16, 12, 64), torch.randn(16, 1, 32)
    with torch.inference_mode():
        want_norm, want_sum = _unfused(monkeypatch, lambda: norm(x.clone(), residual.clone()))
        want_mlp = _unfused(monkeypatch, lambda: mlp(x))
        want_rot = _unfused(monkeypatch, lambda: apply_rotary(qk.clone(), angles.cos(), angles.sin()))
        got_x, got_res = x.clone(), residual.clone()
        got_norm, got_sum = norm(got_x, got_res)
        assert got_norm.data_ptr() == got_x.data_ptr() and got_sum.data_ptr() == got_res.data_ptr()  # in place
        torch.testing.assert_close(got_norm, want_norm, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_sum, want_sum)
        torch.testing.assert_close(mlp(x), want_mlp, atol=1e-5, rtol=1e-5)
        rotated = qk.clone()
        assert apply_rotary(rotated, angles.cos(), angles.sin()).data_ptr() == rotated.data_ptr()
        torch.testing.assert_close(rotated, want_rot, atol=1e-6, rtol=1e-6)


def test_attention_write_kv_takes_the_fused_op(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_kernels, "write_kv", lambda *args: calls.append(args))
    cache, k = torch.zeros(2, 4, 4, 1, 8), torch.randn(3, 1, 8)
    with torch.inference_mode():
        write_kv(cache, torch.tensor([1, 2, 3]), k, k)
    assert len(calls) == 1
    write_kv(cache, torch.tensor([1, 2, 3]), k, k)  # autograd on: index_copy_
    assert len(calls) == 1 and torch.equal(cache[0].view(-1, 1, 8)[1:4], k)


def test_silu_mul_rejects_mismatched_shapes():
    with pytest.raises(RuntimeError, match="silu_mul gate_up"):
        torch.ops.llmserve_cpu.silu_mul(torch.empty(2, 5), torch.randn(2, 8))
