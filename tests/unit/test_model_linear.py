"""model/linear.py: float32 CPU inference on large enough weights goes through oneDNN and matches F.linear; the
rest keeps F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
    calls = []
    monkeypatch.setattr(linear_mod.F, "linear", lambda *a: calls.append(a) or torch.zeros(()))
    w = torch.randn(512, 256)
    for x, weight in [(torch.randn(2, 256, dtype=torch.bfloat16), w.bfloat16()), (torch.randn(3, 2, 256), w),
                      (torch.randn(2, 256), w.clone().requires_grad_()), (torch.randn(2, 4), torch.randn(8, 4))]:
        assert not uses_onednn(x, weight)
        linear(x, weight)
    assert len(calls) == 4


def test_model_layers_are_linear_subclasses():
    """Quantization swaps every nn.Linear: the layers stay nn.Linear subclasses through `linear`."""
    assert isinstance(column_linear(4, 8, False, None), Linear)
    assert isinstance(row_linear(4, 8, True, None), torch.nn.Linear)
